"""The dashboard in a real browser, on a real cluster: what an operator sees and does at ``/dashboard``.

Every part is real: ``vllm-disagg up`` runs the orchestrator, two prefill and two decode agents and
their simulated engines as processes on loopback; Debian's Chromium, headless, driven by Playwright,
loads the page, types the token and clicks. The assertions wait on the page's DOM with deadlines (the
page polls once a second), never on sleeps. A full-page screenshot of every step goes to
``test-artifacts/dashboard/`` for a person to look at.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from playwright.async_api import Page, async_playwright, expect

from tests.e2e.up_support import Cluster, start_up, stop
from tests.helpers import ADMIN, ADMIN_TOKEN, http_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
# Debian's chromium package: Playwright's own browser download cannot be used here.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
MODEL = "sim-model"
# The page polls every second; a busy 2-core machine running a whole cluster may take a lot longer.
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Decode steps of 20 ms keep a 150-token request in flight for about 3 s, long enough for the
    # page's one-second polls to see it live; prefill time makes TTFT more than noise. A role change
    # restarts the engine (as for a vLLM launched kv_producer or kv_consumer). ``--max-crashes 1``: up
    # does not restart the agent this test kills, so the page shows an instance that stays dead.
    running = start_up(
        tmp_path_factory.mktemp("dashboard"),
        2,
        2,
        "--decode-step-s",
        "0.02",
        "--prefill-s-per-token",
        "0.0005",
        "--role-switch",
        "restart",
        "--max-crashes",
        "1",
    )
    yield running
    stop(running)


@dataclass
class Browser:
    """A page in headless Chromium, and the script errors it threw (none, if the page works)."""

    page: Page
    errors: list[str] = field(default_factory=list)

    async def screenshot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await self.page.screenshot(path=ARTIFACTS / name, full_page=True)


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    executable = shutil.which("chromium")
    assert executable, "no chromium on PATH: `make setup-test` installs Debian's (apt-get install chromium)"
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = await chromium.new_context(viewport={"width": 1500, "height": 1000})
            page = await context.new_page()
            opened = Browser(page)
            page.on("pageerror", lambda error: opened.errors.append(str(error)))
            yield opened
        finally:
            await chromium.close()


async def open_dashboard(browser: Browser, cluster: Cluster, token: str) -> None:
    await browser.page.goto(f"{cluster.base}/dashboard")
    await browser.page.fill("#token-input", token)
    await browser.page.click("#token-submit")


def agent_pid(cluster: Cluster, agent_id: str) -> int:
    """The pid of this cluster's agent ``agent_id``: a child of our ``up`` (not another test's) whose
    command line is ``... agent ... --agent-id <agent_id>``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        if ppid != cluster.proc.pid or b"agent" not in argv or b"--agent-id" not in argv:
            continue
        if argv[argv.index(b"--agent-id") + 1] == agent_id.encode():
            return int(entry.name)
    raise AssertionError(f"no agent process for {agent_id} under up (pid {cluster.proc.pid})")


async def admin_instances(cluster: Cluster) -> dict[str, dict[str, object]]:
    status, body = await asyncio.to_thread(http_json, f"{cluster.base}/admin/v1/instances", headers=ADMIN)
    assert status == 200, body
    return {item["agent_id"]: item for item in body["instances"]}


async def complete(http: aiohttp.ClientSession, cluster: Cluster, request_id: str) -> None:
    body = {"model": MODEL, "prompt": f"dashboard request {request_id}, " * 8, "max_tokens": 150}
    headers = {"X-Request-Id": request_id}
    async with http.post(f"{cluster.base}/v1/completions", json=body, headers=headers) as resp:
        # Not asserting "disaggregated": on a loaded machine a prefill may fail over to colocated,
        # and the page shows that too; these tests are about the page.
        assert resp.status == 200, await resp.text()


async def test_a_wrong_token_gets_a_clear_message_and_no_data(cluster: Cluster, browser: Browser) -> None:
    page = browser.page
    await page.goto(f"{cluster.base}/dashboard")
    await expect(page.locator("#welcome")).to_contain_text("admin token")
    await open_dashboard(browser, cluster, "not-the-admin-token")

    error = page.locator("#auth-error")
    await expect(error).to_be_visible(timeout=WAIT_MS)
    await expect(error).to_contain_text("refused the token")
    await expect(error).to_contain_text("wrong admin token")  # the API's own reason
    await expect(page.locator("#connection")).to_have_attribute("data-status", "refused")
    await expect(page.locator("#dashboard")).to_be_hidden()
    assert await page.evaluate("sessionStorage.length") == 0, "a refused token is not kept"
    await browser.screenshot("01-wrong-token.png")

    await page.fill("#token-input", ADMIN_TOKEN)  # the right one, after all
    await page.click("#token-submit")
    await expect(page.locator("#dashboard")).to_be_visible(timeout=WAIT_MS)
    await expect(error).to_be_hidden()
    await page.reload()  # the tab keeps the token: no second prompt
    await expect(page.locator("#dashboard")).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#token-input")).to_have_value("")  # nor is it left in the form
    assert browser.errors == []


async def test_an_operator_watches_requests_sees_a_dead_agent_and_drains_an_instance(
    cluster: Cluster, browser: Browser
) -> None:
    page = browser.page
    await open_dashboard(browser, cluster, ADMIN_TOKEN)
    cards = page.locator(".card[data-instance-id]")

    # The four instances, each in its role's pool, all ready.
    await expect(cards).to_have_count(4, timeout=WAIT_MS)
    for pool, ids in (("prefill", ["prefill-0", "prefill-1"]), ("decode", ["decode-0", "decode-1"])):
        in_pool = page.locator(f"#pool-{pool} .card")
        await expect(in_pool).to_have_count(2)
        for agent_id in ids:
            card = page.locator(f"#pool-{pool} .card[data-instance-id='{agent_id}']")
            await expect(card).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
            await expect(card.locator(".state-badge")).to_have_text("ready")
    await expect(page.locator("#stat-ready-prefill")).to_have_text("2", timeout=WAIT_MS)
    await expect(page.locator("#stat-ready-decode")).to_have_text("2", timeout=WAIT_MS)
    for agent_id in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        joined = page.locator("#events li[data-kind='joined']").filter(has_text=f"{agent_id} joined")
        await expect(joined.first).to_be_visible(timeout=WAIT_MS)
    await browser.screenshot("02-connected.png")

    # Requests: in flight, then in the recent table with the scheduler's pick, and in the P->D flow.
    ids = [f"dash-{uuid.uuid4().hex[:8]}-{i}" for i in range(6)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        sending = asyncio.gather(*(complete(http, cluster, request_id) for request_id in ids))
        try:
            live = page.locator("#live-requests tbody tr[data-client-request-id^='dash-']")
            await expect(live.first).to_be_visible(timeout=WAIT_MS)
            await browser.screenshot("03-requests-in-flight.png")
        finally:
            await sending
    recent = page.locator(f"#recent-requests tbody tr[data-client-request-id='{ids[0]}']")
    await expect(recent).to_be_visible(timeout=WAIT_MS)
    await expect(recent.locator("td").first).to_have_text(ids[0])  # the client's id, as it sent it
    own = await recent.get_attribute("data-request-id")  # the gateway's, which keys the details
    await expect(recent.locator("td.status")).to_have_text("200")
    await expect(recent.locator("td").nth(6)).to_contain_text("decode-")  # the decode pick, with its score
    await expect(recent.locator("td").nth(7)).to_contain_text("prefill-")
    scores = page.locator(f"#recent-requests tr[data-details-for='{own}']")
    await scores.locator("summary").click()  # every candidate's scores, the picks marked
    await expect(scores.locator(".scores tr.picked")).to_have_count(2)  # the decode and the prefill pick
    flow = page.locator("#flow td[data-pair^='prefill-']")
    await expect(flow).to_have_count(4)
    # Sparklines: successive polls after the requests give TTFT points on some decode instance.
    ttft = page.locator("#pool-decode .spark[data-series='ttft']")
    await page.wait_for_function(
        "() => [...document.querySelectorAll(\"#pool-decode .spark[data-series='ttft']\")]"
        ".some(s => Number(s.dataset.points) >= 2)",
        timeout=WAIT_MS,
    )
    await expect(ttft.first.locator("path")).to_have_attribute("d", re.compile(r"^M"))
    # The admission panel counts them admitted (at least these six: the cluster had room for them).
    admitted = page.locator(f"#admission tbody tr[data-model='{MODEL}'] td[data-field='admitted']")
    await expect(admitted).to_have_text(re.compile(r"^([6-9]|[1-9]\d+)$"), timeout=WAIT_MS)
    await browser.screenshot("04-requests-done.png")

    # SIGKILL decode-0's agent: no Goodbye, only silence; the page marks it dead.
    os.kill(agent_pid(cluster, "decode-0"), signal.SIGKILL)
    victim = page.locator(".card[data-instance-id='decode-0']")
    await expect(victim).to_have_attribute("data-state", "dead", timeout=WAIT_MS)
    await expect(victim.locator(".state-badge")).to_have_text("dead")
    await expect(victim.locator(".reason")).to_be_visible()
    no_value = "\N{EN DASH}"  # a dead instance's last scrape is stale: the page shows none
    await expect(victim.locator(".spark[data-series='ttft'] .spark-value")).to_have_text(no_value)
    await expect(victim.locator("button[data-action='drain']")).to_be_disabled()
    died = page.locator("#events li[data-kind='state'][data-to='dead']").filter(has_text="decode-0")
    await expect(died.first).to_be_visible(timeout=WAIT_MS)
    await browser.screenshot("05-agent-killed.png")

    # Drain prefill-1 from its card: the page and the admin API both say it is draining.
    target = page.locator(".card[data-instance-id='prefill-1']")
    await target.locator("button[data-action='drain']").click()
    await expect(target).to_have_attribute("data-state", "draining", timeout=WAIT_MS)
    await expect(target.locator(".flag.draining", has_text="draining (operator)")).to_be_visible()
    await expect(page.locator("#action-status")).to_contain_text("drain prefill-1: done", timeout=WAIT_MS)
    await expect(target.locator("button[data-action='undrain']")).to_be_visible()
    drained = (await admin_instances(cluster))["prefill-1"]
    assert drained["state"] == "draining" and drained["draining"]["admin"] is True  # type: ignore[index]
    await browser.screenshot("06-drained.png")

    # And back: undrain makes it ready again, in the page and in the API.
    await target.locator("button[data-action='undrain']").click()
    await expect(target).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
    assert (await admin_instances(cluster))["prefill-1"]["draining"] == {"agent": False, "admin": False}

    # Make decode-1 (the live decode instance) a prefill one from its card: pick the role, click, and
    # the card moves to the prefill pool; the admin API and the event log say the same.
    mover = page.locator(".card[data-instance-id='decode-1']")
    choice = mover.locator("select.role-select")
    set_role = mover.locator("button[data-action='role']")
    await expect(choice).to_have_value("decode")
    await expect(set_role).to_be_disabled()  # it is decode already: nothing to set
    await choice.select_option("prefill")
    await set_role.click()
    status = page.locator("#action-status")
    await expect(status).to_contain_text(
        "role decode-1: decode → prefill (its engine restarted", timeout=WAIT_MS
    )
    moved = page.locator("#pool-prefill .card[data-instance-id='decode-1']")
    await expect(moved).to_have_attribute("data-role", "prefill", timeout=WAIT_MS)
    await expect(moved).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
    await expect(page.locator("#pool-decode .card[data-instance-id='decode-1']")).to_have_count(0)
    await expect(moved.locator("select.role-select")).to_have_value("prefill")
    await expect(moved.locator("button[data-action='role']")).to_be_disabled()
    await expect(page.locator("#stat-ready-prefill")).to_have_text("3", timeout=WAIT_MS)
    await expect(page.locator("#stat-ready-decode")).to_have_text("0", timeout=WAIT_MS)
    assert (await admin_instances(cluster))["decode-1"]["role"] == "prefill"
    changed = page.locator("#events li[data-kind='role']").filter(has_text="decode-1: role decode → prefill")
    await expect(changed.first).to_be_visible(timeout=WAIT_MS)
    restarted = page.locator("#events li[data-kind='role_restart']")
    for step in ("draining", "restarting", "ready"):
        text = f"decode-1: role decode → prefill by restart: {step}"
        await expect(restarted.filter(has_text=text).first).to_be_visible(timeout=WAIT_MS)
    await browser.screenshot("07-role-changed.png")
    assert browser.errors == [], "the page's script threw"
