"""Record vLLM 0.32's exact response bytes and render every engine dialect's fixtures from them.

Starts one real vLLM (CPU build, the tiny model) unless ``--engine-url`` names a running one, sends each
fixture case with ``X-Request-Id: fixture``, keeps the raw bytes, derives each case's ``Generation``
from its ``return_token_ids`` stream, and checks that ``tests/engines/dialects.py`` re-renders every
recording byte for byte from it (a case whose steps vLLM merged differently between two requests, as it
does when the server is busy, is recorded again). Then it writes ``tests/fixtures/engines/<dialect>.jsonl``
for every dialect from the same generations. Rerunnable; greedy output makes it repeatable.

    .venv/bin/vllm-disagg model tiny --out /tmp/tiny
    .venv/bin/python scripts/record_engine_fixtures.py --model /tmp/tiny
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.engines.dialects import CHAT, COMPLETIONS, DIALECTS, Generation, Step, Vllm032  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "engines"
REQUEST_ID = "fixture"
MODEL = "tiny"
ROUTES = {"completions": COMPLETIONS, "chat": CHAT}
MODES = ("stream-usage", "stream", "whole")
# (route, content) -> (prompt, stop). The multibyte prompts' greedy output has a token that ends inside
# a UTF-8 character (its step's text is "", the next step's carries the bytes); the stop strings really
# stop the output (finish_reason "stop"), with the text lagging the tokens as vLLM holds it back.
CONTENT: dict[tuple[str, str], tuple[str, str | None]] = {
    ("completions", "plain"): ("def main(", None),
    ("completions", "stop"): ("def main(", "contain"),
    ("completions", "multibyte"): ("日本語", None),
    ("chat", "plain"): ("hi", None),
    ("chat", "stop"): ("hi", " 2c"),
    ("chat", "multibyte"): ("é", None),
}
ENGINE_FLAGS = [
    "--served-model-name", MODEL, "--max-model-len", "512", "--dtype", "float32", "--max-num-seqs", "8",
    "--enforce-eager", "--block-size", "128", "--enable-prompt-tokens-details",
]  # fmt: skip


def case_name(route: str, mode: str, content: str, ids: bool) -> str:
    return f"{route}-{mode}-{content}" + ("-ids" if ids else "")


def request_body(route: str, mode: str, content: str, ids: bool) -> dict[str, Any]:
    prompt, stop = CONTENT[route, content]
    body: dict[str, Any] = {"model": MODEL}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update({"max_tokens": 12, "temperature": 0})
    if stop:
        body["stop"] = stop
    if mode != "whole":
        body["stream"] = True
    if mode == "stream-usage":
        body["stream_options"] = {"include_usage": True}
    if ids:
        body["return_token_ids"] = True
    return body


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, str, str]:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": REQUEST_ID}
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def created_of(body: str) -> int:
    found = re.search(r'"created":(\d+)', body)
    assert found, body[:200]
    return int(found.group(1))


def generation(path: str, body: str) -> Generation:
    """What vLLM 0.32 generated, read from its stream with return_token_ids and include_usage."""
    prompt: list[int] = []
    steps: list[Step] = []
    finish: tuple[str, str | int | None] = ("", None)
    cached = None
    for raw in body.split("\n\n"):
        if not raw.startswith("data: {"):
            continue
        chunk = json.loads(raw.removeprefix("data: "))
        prompt = chunk.get("prompt_token_ids") or prompt
        for choice in chunk["choices"]:
            prompt = choice.get("prompt_token_ids") or prompt
            if "token_ids" not in choice:  # chat's role chunk
                continue
            text = choice["delta"]["content"] if path == CHAT else choice["text"]
            steps.append(Step(tuple(choice["token_ids"]), text))
            if choice["finish_reason"]:
                finish = (choice["finish_reason"], choice["stop_reason"])
        if chunk.get("usage"):
            cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    return Generation(tuple(prompt), tuple(steps), finish[0], finish[1], cached)


def fingerprint_of(body: str) -> str | None:
    found = re.search(r'"system_fingerprint":"([^"]+)"', body)
    return found.group(1) if found else None


def record_group(url: str, route: str, content: str, tries: int) -> list[dict[str, Any]]:
    """Every mode and return_token_ids variant of one prompt, rendered back from one generation."""
    path = ROUTES[route]
    for attempt in range(1, tries + 1):
        lines = []
        for mode in MODES:
            for ids in (True, False):
                body = request_body(route, mode, content, ids)
                status, content_type, text = post(url, path, body)
                assert status == 200, (status, text[:500])
                lines.append({
                    "case": case_name(route, mode, content, ids), "path": path, "request": body,
                    "request_id": REQUEST_ID, "status": status, "content_type": content_type, "body": text,
                    "created": created_of(text),
                })  # fmt: skip
        gen = generation(path, lines[0]["body"])  # stream-usage with return_token_ids
        seen = fingerprint_of(lines[0]["body"])
        vllm = DIALECTS["vllm-0.32"]
        assert isinstance(vllm, Vllm032)
        if seen != vllm.fingerprint:
            raise SystemExit(f"this engine's system_fingerprint is {seen}: set Vllm032.fingerprint to it")
        for line in lines:
            line["generation"] = gen.to_json()
        if all(rerendered(vllm, line, gen) == line["body"] for line in lines):
            return lines
        print(f"{route}-{content}: vLLM merged steps differently (try {attempt}), recording again")
    raise SystemExit(f"{route}-{content}: no consistent recording in {tries} tries")


def rerendered(dialect: Any, line: dict[str, Any], gen: Generation) -> str:
    _, _, body = dialect.render(line["path"], line["request"], gen, line["request_id"], line["created"])
    return str(body.decode())


def check_contents(lines: list[dict[str, Any]]) -> None:
    """The multibyte and stop cases show what they are named for."""
    for line in lines:
        gen = Generation.from_json(line["generation"])
        if "-multibyte" in line["case"]:
            held = [i for i, s in enumerate(gen.steps[:-1]) if not s.text and gen.steps[i + 1].text]
            assert held, f"{line['case']}: no step held bytes back: {gen.steps}"
        if "-stop" in line["case"]:
            assert gen.finish_reason == "stop" and gen.stop_reason, f"{line['case']}: did not stop"


def dialect_lines(name: str, recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded cases as dialect ``name`` answers them (vLLM 0.32: the recordings themselves)."""
    if name == "vllm-0.32":
        return recorded
    dialect = DIALECTS[name]
    lines = []
    for line in recorded:
        gen = Generation.from_json(line["generation"])
        status, content_type, body = dialect.render(
            line["path"], line["request"], gen, line["request_id"], line["created"]
        )
        lines.append({**line, "status": status, "content_type": content_type, "body": body.decode()})
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_engine(model: str, log: Path) -> Iterator[str]:
    """One vLLM 0.32 on the CPU build, as the e2e tests start it (no KV connector); its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1"]
    argv += ["--port", str(port), *ENGINE_FLAGS]
    env = {
        **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": "auto", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT": "0",
    }  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited with {proc.returncode}; see {log}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"vLLM not healthy after 600 s; see {log}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def record(url: str, tries: int) -> list[dict[str, Any]]:
    recorded = []
    for route, content in CONTENT:
        recorded += record_group(url, route, content, tries)
    check_contents(recorded)
    return recorded


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="/tmp/tiny", help="the tiny model's folder (vllm-disagg model tiny)"
    )
    parser.add_argument("--engine-url", help="record from this running vLLM 0.32 instead of starting one")
    parser.add_argument("--tries", type=int, default=8, help="recordings of a case before giving up")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.engine_url:
        recorded = record(args.engine_url.rstrip("/"), args.tries)
    else:
        with running_engine(args.model, Path("/tmp/record_engine_fixtures.vllm.log")) as url:
            recorded = record(url, args.tries)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in DIALECTS:
        lines = dialect_lines(name, recorded)
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        (args.out / f"{name}.jsonl").write_text(text, encoding="utf-8")
        print(f"{args.out / name}.jsonl: {len(lines)} cases")


if __name__ == "__main__":
    main()
