"""Agent authentication: CurveZMQ keys, and the ZAP handler that admits only listed agents.

The orchestrator has a keypair; each agent has its own. The orchestrator lists the agents' public keys
in a directory, one ``<agent id>.key`` file each: a connection is admitted only if its key is listed
there (libzmq refuses any other during the handshake, before a single frame is read), and every frame
it sends carries that key's agent id as its ZMQ ``User-Id``, which binds the id to the key.

Key files are ZeroMQ certificates (``zmq.auth``): ``NAME.key`` holds the public key, ``NAME.key_secret``
both (mode 0600). ``vllm-disagg keys`` makes them; only their paths ever appear on a command line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from vllm_disagg.errors import ConfigError
from vllm_disagg.private_files import private_dir, write_private

SECRET_SUFFIX = ".key_secret"
PUBLIC_SUFFIX = ".key"


@dataclass(frozen=True, slots=True)
class Keypair:
    """One side's CurveZMQ keys (z85 bytes, as libzmq takes them)."""

    public: bytes
    secret: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class ServerCurve:
    """The orchestrator's keys and the agents it admits: public key (z85) -> agent id."""

    keys: Keypair
    agents: Mapping[bytes, str]


@dataclass(frozen=True, slots=True)
class ClientCurve:
    """An agent's keys and the orchestrator's public key it expects."""

    keys: Keypair
    server_public: bytes


def make_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` in ``directory`` (made 0700, this user's); their paths.

    The secret file is 0600 from its creation: ``zmq.auth.create_certificates`` writes it under the
    umask and leaves the mode to the caller, so a reader could open it before a ``chmod``.
    """
    private_dir(directory)
    public_key, secret_key = zmq.curve_keypair()
    public, secret = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
    write_public(public, public_key)
    write_private(secret, _certificate("Secret", public_key, secret_key).encode())
    return public, secret


def load_keypair(path: str) -> Keypair:
    """The keys of a ``.key_secret`` file (``ConfigError`` if it is not one)."""
    public, secret = _load(path)
    if secret is None:
        raise ConfigError(f"{path} holds no secret key (give the .key_secret file, not the .key)")
    return Keypair(public, secret)


def load_public(path: str) -> bytes:
    """The public key of a ``.key`` (or ``.key_secret``) file."""
    return _load(path)[0]


def load_agent_keys(directory: str) -> dict[bytes, str]:
    """Public key -> agent id from every ``<agent id>.key`` in ``directory``.

    ``ConfigError`` for a directory without any, or two ids sharing one key (a key names one agent).
    """
    try:
        files = sorted(p for p in Path(directory).iterdir() if p.name.endswith(PUBLIC_SUFFIX))
    except OSError as exc:
        raise ConfigError(
            f"cannot read the agent keys directory {directory}: {exc.strerror or exc}"
        ) from None
    agents: dict[bytes, str] = {}
    for path in files:
        agent_id = path.name[: -len(PUBLIC_SUFFIX)]
        key = load_public(str(path))
        if key in agents:
            raise ConfigError(f"agents {agents[key]!r} and {agent_id!r} share one key in {directory}")
        agents[key] = agent_id
    if not agents:
        raise ConfigError(f"no agent public keys (<agent id>{PUBLIC_SUFFIX}) in {directory}")
    return agents


def write_public(path: Path, public_key: bytes) -> None:
    """Write a ``.key`` file holding only ``public_key`` (z85), in the format ``load_public`` reads."""
    path.write_text(_certificate("Public", public_key))


def _certificate(kind: str, public_key: bytes, secret_key: bytes | None = None) -> str:
    """A ZeroMQ certificate file's text (``zmq.auth``'s format, which ``load_certificate`` reads)."""
    text = f'#   ZeroMQ CURVE {kind} Certificate\nmetadata\ncurve\n    public-key = "{public_key.decode()}"\n'
    if secret_key is not None:
        text += f'    secret-key = "{secret_key.decode()}"\n'
    return text


def _load(path: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the CurveZMQ key file {path}: {exc}") from None


class _Credentials:
    def __init__(self, agents: Mapping[bytes, str], on_denied: Callable[[], None]) -> None:
        self._agents = agents
        self._on_denied = on_denied

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._agents
        if not allowed:
            self._on_denied()
        return allowed


class AgentAuthenticator(AsyncioAuthenticator):
    """Admits the listed agents' keys; each admitted connection's frames carry its agent id."""

    def __init__(
        self, context: zmq.asyncio.Context, agents: Mapping[bytes, str], on_denied: Callable[[], None]
    ) -> None:
        super().__init__(context)
        self._agents = dict(agents)
        self._on_denied = on_denied

    def start(self) -> None:
        """Serve ZAP requests on this context (before the ROUTER binds)."""
        super().start()
        self.configure_curve_callback("*", credentials_provider=_Credentials(self._agents, self._on_denied))

    def admit(self, public_key: bytes, agent_id: str) -> None:
        """Admit one more agent's key (z85) from now on (an agent the orchestrator spawned itself)."""
        self._agents[public_key] = agent_id  # the credentials provider reads this same dict

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The agent id the admitted key belongs to."""
        return self._agents[zmq.utils.z85.encode(client_public_key)]


def setup_server(sock: zmq.asyncio.Socket, curve: ServerCurve) -> None:
    """Make ``sock`` a CURVE server with the orchestrator's keys (before it binds)."""
    sock.curve_server = True
    sock.curve_secretkey = curve.keys.secret
    sock.curve_publickey = curve.keys.public


def setup_client(sock: zmq.asyncio.Socket, curve: ClientCurve) -> None:
    """Make ``sock`` a CURVE client of the orchestrator (before it connects)."""
    sock.curve_secretkey = curve.keys.secret
    sock.curve_publickey = curve.keys.public
    sock.curve_serverkey = curve.server_public
