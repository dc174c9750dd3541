"""Every omnishm knob in one table: CLI flag, ``OMNISHM_<KNOB>`` variable, TOML key.

``KNOBS`` is the single source of truth: the committer's argparse options,
the client settings a runner reads, the environment names, the checks and
the documentation table (``markdown_table``; ``python -m omnishm.config``
prints it) all come from it.

Precedence, highest first: command-line flag, environment variable
(``OMNISHM_<KNOB>``, e.g. ``OMNISHM_STAGING_DEPTH=8``), TOML file (top-level
keys named like the knobs; given by ``--config FILE`` or ``$OMNISHM_CONFIG``),
built-in default. Every value is checked (type, range, choices, loopback-only
hosts); a bad one raises ``ConfigError`` naming the knob, where the value came
from and the rule.

Plain values only: nothing here imports torch, zmq or vllm, so the CLI and a
refused committer start stay fast. Pure functions; safe from any thread.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from omnishm import cpus  # standard library only
from omnishm.committer import stores  # standard library only
from omnishm.interface import MAX_TIMEOUT_S, PrefixCacheConfig
from omnishm.shm import is_cache_name  # the one rule of a cache name

CONFIG_ENV = "OMNISHM_CONFIG"
ENV_PREFIX = "OMNISHM_"
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


MAX_IPC_PATH_BYTES = 107
"""Bytes of an ipc socket path: Linux's ``sockaddr_un.sun_path`` holds 108, the last a NUL (``zmq.IPC_PATH_MAX_LEN``)."""
MIN_HEARTBEAT_S = 0.01
"""The committer's loop looks at its clients' silence every 10 ms at the most: a shorter beat is not heard."""
MIN_HEARTBEAT_TIMEOUT_S = 1.0
"""Both sides take a pause of up to a second (the GIL held elsewhere, a loaded host) for no stall of theirs
(``Server.note_stall``, ``LinkIO``): a timeout under it reaped live clients, a writer's staging with them,
and the writer's resume was refused for good (0.1 s beats and a 0.2 s timeout did so in 2 runs of 2: review,
stop 54)."""


class ConfigError(ValueError):
    """A knob value (or config file) that cannot be used; the message says which, from where, and why."""


# ---------------------------------------------------------------- checks (return the value or raise ValueError)


def check_endpoint(endpoint: str) -> str:
    """Return ``endpoint`` if allowed: ``ipc://PATH`` or ``tcp://`` on a loopback host.

    Raises ValueError naming the endpoint and the rule otherwise (the pool is
    readable by anyone who can talk to the committer, so never a routable address).
    """
    if not endpoint.isprintable():
        # A newline (a YAML block value), tab or other control character: urlsplit drops some before parsing, so a
        # tcp endpoint passed this check and the client's connect raised a bare ZMQError (mutation review,
        # 2026-12-06); in an ipc path it names a file nobody meant.
        raise ValueError(f"endpoint {endpoint!r} has a control character (a newline, tab, ...)")
    if endpoint.startswith("ipc://"):
        if len(endpoint) <= len("ipc://"):
            raise ValueError(f"endpoint {endpoint!r} has no socket path")
        if endpoint[len("ipc://"):] != endpoint[len("ipc://"):].strip():
            # "ipc:// " bound a socket named " " in the working directory, as a runtime dir " " did (review,
            # stop 54)
            raise ValueError(f"endpoint {endpoint!r}: its socket path has leading or trailing whitespace")
        length = len(os.fsencode(endpoint[len("ipc://"):]))
        if length > MAX_IPC_PATH_BYTES:
            # The committer made a segment before its bind failed on it, and a client's connect raised a bare
            # ZMQError naming neither the endpoint nor the runtime dir (review, stop 54).
            raise ValueError(f"endpoint {endpoint!r}: its socket path is {length} bytes, over the "
                             f"{MAX_IPC_PATH_BYTES} a unix socket address holds; use a shorter runtime dir or "
                             f"endpoint")
        if endpoint.startswith("ipc://@"):
            # ZeroMQ's Linux abstract socket: no file, so no 0600 mode keeps other users out, and the
            # committer took "@NAME" for a file in its working directory (it removed one there).
            raise ValueError(f"endpoint {endpoint!r} refused: abstract ipc sockets have no file permissions; "
                             f"use ipc://PATH")
        return endpoint
    if endpoint.startswith("tcp://"):
        parts = urlsplit(endpoint)
        try:
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ValueError(f"endpoint {endpoint!r}: bad port ({exc})") from None
        if host not in LOOPBACK_HOSTS:
            raise ValueError(f"endpoint {endpoint!r} refused: tcp is allowed only on loopback "
                             f"({', '.join(LOOPBACK_HOSTS)}), never on {host!r}")
        # ZeroMQ takes tcp://HOST:PORT and nothing more: a path, query or user part passed here, and a client's
        # connect then raised a bare ZMQError (review, 2026-12-06).
        if parts.username is not None or parts.path or parts.query or parts.fragment or endpoint.endswith(("?", "#")):
            raise ValueError(f"endpoint {endpoint!r} refused: use tcp://HOST:PORT, with no user, path or query")
        if port is None:
            raise ValueError(f"endpoint {endpoint!r} has no port")
        if port == 0:  # ZeroMQ binds any free port then, and no client can know which
            raise ValueError(f"endpoint {endpoint!r} refused: port 0 binds a port no client knows; name one")
        return endpoint
    raise ValueError(f"endpoint {endpoint!r} refused: use ipc://PATH or tcp://127.0.0.1:PORT")


def _check_name(value: str) -> str:
    if not is_cache_name(value):
        raise ValueError("use 1-64 letters, digits, '_' or '-'")
    return value


def _check_loopback(value: str) -> str:
    if value not in LOOPBACK_HOSTS:
        raise ValueError(f"metrics are served on loopback only ({', '.join(LOOPBACK_HOSTS)}); "
                         f"put a proxy in front to expose them")
    return value


def _check_level(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        raise ValueError(f"use one of {', '.join(LOG_LEVELS)}")
    return value.upper()


# ---------------------------------------------------------------- the knob table


@dataclass(frozen=True)
class Knob:
    """One setting. ``scope``: ``both``, ``committer`` or ``client``; ``type``: int, float, bool, str, path."""

    name: str
    type: str
    default: Any
    help: str
    scope: str = "both"
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    check: Callable[[Any], Any] | None = None
    env_aliases: tuple[str, ...] = ()
    default_doc: str | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _pcc_default(name: str) -> Any:
    return {f.name: f.default for f in fields(PrefixCacheConfig)}[name]


KNOBS: tuple[Knob, ...] = (
    Knob("name", "str", "default", "cache name (committer and clients must agree)", check=_check_name,
         env_aliases=("OMNISHM_CACHE",)),
    Knob("runtime_dir", "path", None, "0700 directory for the socket and lock file",
         default_doc="$XDG_RUNTIME_DIR/omnishm or /tmp/omnishm-UID"),
    Knob("endpoint", "str", None, "ZeroMQ endpoint; tcp only on loopback. A cache name given explicitly (a "
         "manager's `cache=`, the `--name` of an `omnishm` command) without an endpoint means that cache's own "
         "socket", check=check_endpoint,
         default_doc="ipc://RUNTIME_DIR/NAME.sock"),
    Knob("heartbeat_s", "float", 1.0, "heartbeat interval the committer tells clients to use", scope="committer",
         min=MIN_HEARTBEAT_S, max=MAX_TIMEOUT_S),
    Knob("heartbeat_timeout_s", "float", 10.0, "reap a client silent this long (at least 2 x heartbeat_s)",
         scope="committer", min=MIN_HEARTBEAT_TIMEOUT_S, max=MAX_TIMEOUT_S),
    Knob("exit_when_idle", "bool", False,
         "exit once the last writer/reader left (after one attached), or when none attached within 60 s "
         "(an autostarted one: or once the process that started it is gone)",
         scope="committer"),
    Knob("exit_with_parent", "bool", False,
         "stop, as on SIGTERM (every segment unlinked), once the process that started it is gone: for a "
         "supervisor or a test run whose crash must leave nothing behind; `--parent-pid PID` names that process, "
         "so that one gone before the options were read is caught too (an autostarted committer ignores it: it "
         "watches its client instead)", scope="committer"),
    Knob("prefault", "bool", False, "fault every pool page in at creation; the committer's loop answers nothing "
         "meanwhile (0.3-1.2 s per GiB of a key's pool): keep heartbeat_timeout_s above that for the largest key, "
         "or its clients resume", scope="committer"),
    Knob("nontemporal_threshold", "int", stores.DEFAULT_BYTES,
         "bytes from which the committer's row copies use non-temporal stores (glibc on x86-64; 0: glibc's "
         "own threshold, tens of MiB or more)", scope="committer", min=0, check=stores.check_threshold),
    Knob("metrics_port", "int", 0, "Prometheus /metrics and /health port (0: off)", scope="committer",
         min=0, max=65535),
    Knob("metrics_host", "str", "127.0.0.1", "address the metrics port binds (loopback only)", scope="committer",
         check=_check_loopback),
    Knob("log_level", "str", "INFO", f"committer log level ({', '.join(LOG_LEVELS)})", scope="committer",
         check=_check_level),
    Knob("autostart", "bool", True, "start an embedded committer when none answers (ipc only)", scope="client"),
    Knob("connect_timeout_s", "float", 30.0, "how long a client waits for the committer's Welcome",
         scope="client", min=0, min_exclusive=True, max=MAX_TIMEOUT_S),
    Knob("staging_depth", "int", _pcc_default("staging_depth"),
         "unconsumed step ids a client may hold (a writer's are staging pages)", scope="client", min=1),
    Knob("staging_capacity_tokens", "int", _pcc_default("staging_capacity_tokens"),
         "rows of one staging page (one step)", scope="client", min=1,
         default_doc=f"{_pcc_default('staging_capacity_tokens')} (vLLM: max_num_batched_tokens)"),
    Knob("staging_claim_timeout_s", "float", _pcc_default("staging_claim_timeout_s"),
         "how long a save waits for a free staging page; a writer's save with deferred rows may first wait as "
         "long again, on its own, for deferred writes to land (gpu_staging_bytes)", scope="client", min=0,
         min_exclusive=True, max=MAX_TIMEOUT_S),
    Knob("gpu_staging_bytes", "int", _pcc_default("gpu_staging_bytes"),
         "bytes of deferred (JOIN_ON_FINISH) row copies held (device clones on CUDA, host clones on CPU; "
         "each step's clone of a key counted whole, once): past it open writes are flushed, oldest first, until the "
         "clones they hold fit again (writes sharing a step's clone go out together), and a writer's "
         "save with deferred rows waits (up to staging_claim_timeout_s) while the writes not landed yet hold "
         "more", scope="client", min=1),
    Knob("copy_chunk_bytes", "int", _pcc_default("copy_chunk_bytes"),
         "bytes of a deferred write per message through the staging flush region (a step's write waits behind "
         "at most one)", scope="client", min=1),
    Knob("commit_timeout_s", "float", _pcc_default("commit_timeout_s"),
         "how long a client waits for a committer reply", scope="client", min=0, min_exclusive=True,
         max=MAX_TIMEOUT_S),
    Knob("reconnect_timeout_s", "float", _pcc_default("reconnect_timeout_s"),
         "how long a client tries to resume with a restarted committer", scope="client", min=0,
         min_exclusive=True, max=MAX_TIMEOUT_S),
    Knob("result_pool_bytes", "int", _pcc_default("result_pool_bytes"),
         "free pre-faulted host memory kept for materialize's results (0: fresh pages every call)",
         scope="client", min=0),
    Knob("token_check", "bool", _pcc_default("token_check"),
         "the writer checks each prefix hit's rows against the hit request's token ids and raises on rows "
         "computed for other tokens (off: it serves what the slots hold)", scope="client"),
    Knob("helper_sched", "str", "inherit",
         "scheduling policy of omnishm's threads in a client's process: inherit (the policy of the thread that "
         "builds the manager) or batch (SCHED_BATCH: a thread the engine thread wakes does not preempt it; for "
         "hosts whose other cores do real work, not where every core busy-waits)", scope="client",
         check=cpus.check_helper_sched),
    Knob("vllm_held_bytes", "int", 1 << 30,
         "vLLM extension: completed prompts' rows kept for omnishm_take_* (beyond it the oldest are dropped)",
         scope="client", min=0),
    Knob("vllm_capture_raw", "bool", False,
         "vLLM extension: also keep no-hit prompts' rows read from the runner (a check; a second copy)",
         scope="client"),
    Knob("vllm_omni", "bool", False,
         "vllm-omni: its model runners build omnishm's drop-in cache (vLLM plugin, read in every vLLM process)",
         scope="client"),
)

VLLM_KNOBS = ("vllm_held_bytes", "vllm_capture_raw", "vllm_omni")
BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}
PREFIX_CACHE_KNOBS = ("staging_depth", "staging_capacity_tokens", "staging_claim_timeout_s", "gpu_staging_bytes",
                      "copy_chunk_bytes", "commit_timeout_s", "reconnect_timeout_s", "result_pool_bytes",
                      "token_check")


def knobs(scope: str) -> list[Knob]:
    """The knobs a ``committer`` or ``client`` reads (``both`` knobs included)."""
    return [k for k in KNOBS if k.scope in ("both", scope)]


# ---------------------------------------------------------------- conversion


def convert(knob: Knob, raw: Any, source: str) -> Any:
    """``raw`` (a string from a flag or variable, or a TOML value) as the knob's type, checked.

    Raises ConfigError naming the knob, the source and the rule.
    """
    where = f"{knob.name} = {raw!r} (from {source})"
    try:
        value = _typed(knob, raw)
        if knob.min is not None and (value <= knob.min if knob.min_exclusive else value < knob.min):
            raise ValueError(f"must be {'>' if knob.min_exclusive else '>='} {knob.min:g}")
        if knob.max is not None and value > knob.max:
            raise ValueError(f"must be <= {knob.max:g}")
        if knob.check is not None and value is not None:
            value = knob.check(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"bad {where}: {exc}") from None
    return value


def _typed(knob: Knob, raw: Any) -> Any:
    if knob.type == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
            return raw.strip().lower() in _TRUE
        raise ValueError(f"expected a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")
    if knob.type == "int":
        if isinstance(raw, bool) or isinstance(raw, float):
            raise ValueError("expected an integer")
        if isinstance(raw, str):
            text = raw.strip().replace("_", "")
            # Decimal unless it says 0x, 0o or 0b: base 0 alone refused "08" as "expected an integer" (review).
            prefixed = text.lstrip("+-")[:2].lower() in ("0x", "0o", "0b")
            try:
                return int(text, 0 if prefixed else 10)
            except ValueError:
                raise ValueError("expected an integer") from None
        if isinstance(raw, int):
            return raw
        raise ValueError("expected an integer")
    if knob.type == "float":
        if isinstance(raw, bool):
            raise ValueError("expected a number")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError("expected a number") from None
        if not math.isfinite(value):  # nan passes every bound check, inf makes a deadline that never comes
            raise ValueError("expected a finite number")
        return value
    if not isinstance(raw, (str, os.PathLike)):
        raise ValueError("expected a string")
    text = os.fspath(raw)
    if knob.type == "path":
        if not text.strip():
            raise ValueError("expected a non-empty path")
        if text != text.strip():
            # " " was taken as a directory named " " under the working directory, so a client started
            # elsewhere looked for the socket in another place (review, stop 54)
            raise ValueError("a path with leading or trailing whitespace")
        return Path(text)
    return text


# ---------------------------------------------------------------- files


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """Top-level keys of a TOML file. Raises ConfigError (unreadable, bad TOML, unknown key, no parser)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(f"config file {path}: reading TOML needs Python >= 3.11 or `pip install tomli`") \
                from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8: tomllib raises the latter
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    for key in data:
        if key not in BY_NAME:
            near = difflib.get_close_matches(key.replace("-", "_"), BY_NAME, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"config file {path}: unknown key {key!r}{hint}; known keys: {', '.join(BY_NAME)}")
    return data


# ---------------------------------------------------------------- resolution


@dataclass(frozen=True)
class Resolved:
    """Final knob values and where each came from (``flag``, ``env OMNISHM_X``, ``file PATH``, ``default``)."""

    values: dict[str, Any]
    sources: dict[str, str]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def resolve(scope: str = "both", flags: Mapping[str, Any] | None = None, *,
            env: Mapping[str, str] | None = None, config_file: str | os.PathLike | None = None,
            names: tuple[str, ...] | None = None, given_as: str = "flag") -> Resolved:
    """Knob values for ``scope`` (``committer``, ``client`` or ``both``): flags > env > file > defaults.

    ``flags``: values given on the command line (absent or None: not given), or, with ``given_as="keyword"``,
    as keyword arguments of a Python call (an error then names ``keyword NAME=``, not a flag nobody gave).
    ``names``: resolve only these knobs (a tool that needs three knobs does not
    fail on a bad unrelated one).
    ``env``: defaults to ``os.environ``. ``config_file``: defaults to ``$OMNISHM_CONFIG``
    (no file when neither is set). Raises ConfigError on any bad value, even one
    that a higher-precedence source overrides, so a broken file never hides.
    """
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = set(flags) - set(BY_NAME)
    if unknown:
        raise ConfigError(f"unknown knob(s) {', '.join(sorted(unknown))}; known: {', '.join(BY_NAME)}")
    path = config_file if config_file is not None else (env.get(CONFIG_ENV) or None)
    file_values = load_file(path) if path else {}
    selected = KNOBS if scope == "both" else knobs(scope)
    # A knob of the other side was dropped without a word, a bad value too: client_settings(heartbeat_s="fast")
    # returned normally and changed nothing (mutation review, 2026-12-06).
    elsewhere = sorted(set(flags) - {k.name for k in selected}) if names is None else []
    if elsewhere:
        raise ConfigError(f"{', '.join(elsewhere)}: not read by a {scope} (a {BY_NAME[elsewhere[0]].scope} knob); "
                          f"set it where the {BY_NAME[elsewhere[0]].scope} reads its knobs: its flag, OMNISHM_* or "
                          f"the config file")
    if names is not None:
        selected = [k for k in selected if k.name in names]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for knob in selected:
        value, source = knob.default, "default"
        if knob.name in file_values:
            source = f"file {path}"
            value = convert(knob, file_values[knob.name], source)
        for var in (*reversed(knob.env_aliases), knob.env):  # the primary name wins over an alias
            if env.get(var, "") != "":
                source = f"env {var}"
                value = convert(knob, env[var], source)
        if knob.name in flags:
            source = f"flag {knob.flag}" if given_as == "flag" else f"keyword {knob.name}="
            value = convert(knob, flags[knob.name], source)
        values[knob.name] = value
        sources[knob.name] = source
    # A client's beats come a little more than heartbeat_s apart (its I/O thread wakes on a tick), so a timeout
    # of one period reaped every idle client, a writer's staging with it, and its resume was refused (review).
    # The timeout's floor of its own (MIN_HEARTBEAT_TIMEOUT_S) is the knob's minimum.
    if "heartbeat_s" in values and "heartbeat_timeout_s" in values \
            and values["heartbeat_timeout_s"] < 2 * values["heartbeat_s"]:
        raise ConfigError(f"heartbeat_timeout_s = {values['heartbeat_timeout_s']:g} "
                          f"(from {sources['heartbeat_timeout_s']}) is under two heartbeat_s = "
                          f"{values['heartbeat_s']:g} (from {sources['heartbeat_s']}): idle clients would be reaped "
                          f"between two of their heartbeats")
    return Resolved(values, sources)


# ---------------------------------------------------------------- argparse


def seconds_argument(text: str) -> float:
    """argparse type of a wait's seconds outside the knobs (``ping --timeout-s``, ``demo --timeout-s``): > 0
    and <= ``MAX_TIMEOUT_S``. A ZeroMQ poll of ``inf`` (or 1e300) s raised OverflowError, a process join of
    ``inf`` too, and ``nan`` or a negative wait ran the demo only to report every rank timed out."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= MAX_TIMEOUT_S:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0 and <= {MAX_TIMEOUT_S:g}, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser, scope: str, *, config_flag: bool = True) -> None:
    """Add a flag per knob of ``scope`` (default: not given, so env/file/default apply) and ``--config``."""
    if config_flag:
        parser.add_argument("--config", metavar="FILE", default=None,
                            help=f"TOML file of knob = value lines (default: ${CONFIG_ENV})")
    for knob in knobs(scope):
        default = knob.default_doc or knob.default
        text = f"{knob.help} (env {knob.env}; default {default})"
        if knob.type == "bool":
            parser.add_argument(knob.flag, dest=knob.name, action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        else:
            parser.add_argument(knob.flag, dest=knob.name, default=None, metavar=knob.name.upper(), help=text)


def flags_from_args(args: argparse.Namespace, scope: str) -> dict[str, Any]:
    """The knob flags actually given in ``args`` (parsed by a parser built with ``add_arguments``)."""
    return {k.name: getattr(args, k.name) for k in knobs(scope) if getattr(args, k.name, None) is not None}


# ---------------------------------------------------------------- client side


@dataclass(frozen=True)
class ClientSettings:
    """What a runner needs to attach: cache name, endpoint, autostart, timeouts and the cache sizing knobs."""

    name: str
    runtime_dir: Path | None
    endpoint: str | None
    autostart: bool
    connect_timeout_s: float
    prefix_cache: dict[str, Any]
    vllm: dict[str, Any] = field(default_factory=dict)
    """The vLLM integrations' own knobs (``VLLM_KNOBS``): the extension's and the vllm-omni plugin's."""
    config_file: str | os.PathLike | None = None
    """The file given to ``client_settings`` (None: ``$OMNISHM_CONFIG``), passed on to an autostarted committer
    (``OmniPrefixCacheManager`` makes it absolute)."""

    def manager_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``OmniPrefixCacheManager`` besides the config and role."""
        return {**{arg: getattr(self, knob) for arg, knob in _CONNECTION.items()}, "config_file": self.config_file}


_CONNECTION = {"cache": "name", "endpoint": "endpoint", "autostart": "autostart", "runtime_dir": "runtime_dir",
               "connect_timeout_s": "connect_timeout_s"}
"""``OmniPrefixCacheManager``'s connection arguments and the knobs they default to."""


def manager_connection(*, config_file: str | os.PathLike | None = None, **given: Any) -> dict[str, Any]:
    """``OmniPrefixCacheManager``'s connection arguments (``_CONNECTION``), each one not given (None) from
    ``OMNISHM_*``, the config file or the default; only those knobs are read (a bad unrelated one does not
    stop a manager). ``endpoint`` comes from there only when ``cache`` does too: an explicit cache name
    without an endpoint means that cache's own socket. Raises ConfigError on a bad value of a knob read.
    """
    unknown = set(given) - set(_CONNECTION)
    if unknown:
        raise ConfigError(f"manager_connection: {', '.join(sorted(unknown))} not a connection argument")
    # What the caller gave is checked like a flag (README: every value is checked; tcp only on loopback).
    given = {k: v if v is None else convert(BY_NAME[_CONNECTION[k]], v, f"argument {k}=") for k, v in given.items()}
    missing = [k for k, v in given.items() if v is None and (k != "endpoint" or given.get("cache") is None)]
    if not missing:
        return dict(given)
    values = resolve("client", config_file=config_file, names=tuple(_CONNECTION[k] for k in missing)).values
    return {**given, **{k: values[_CONNECTION[k]] for k in missing}}


def client_settings(*, env: Mapping[str, str] | None = None, config_file: str | os.PathLike | None = None,
                    **overrides: Any) -> ClientSettings:
    """Client knobs from ``overrides`` (like flags: highest) > ``OMNISHM_*`` > TOML file > defaults.

    Raises ConfigError on a bad value or an unknown override.
    """
    r = resolve("client", overrides, env=env, config_file=config_file, given_as="keyword")
    v = r.values
    return ClientSettings(name=v["name"], runtime_dir=v["runtime_dir"], endpoint=v["endpoint"],
                          autostart=v["autostart"], connect_timeout_s=v["connect_timeout_s"],
                          prefix_cache={k: v[k] for k in PREFIX_CACHE_KNOBS}, vllm={k: v[k] for k in VLLM_KNOBS},
                          config_file=config_file)


def load_prefix_cache_config(num_blocks: int, block_size: int, *, derived: Mapping[str, Any] | None = None,
                             env: Mapping[str, str] | None = None, config_file: str | os.PathLike | None = None,
                             **overrides: Any) -> PrefixCacheConfig:
    """A ``PrefixCacheConfig`` for this geometry: overrides > env > file > ``derived`` > built-in defaults.

    ``derived``: values the runner computed from vLLM (e.g. ``staging_capacity_tokens=
    max_num_batched_tokens``); they replace the built-in defaults, so
    ``OMNISHM_STAGING_CAPACITY_TOKENS`` or the file still beat them.
    ``overrides``: explicit values (rank like flags). ``OMNISHM_STAGING_DEPTH=8``
    changes the depth without code. Both must name ``PrefixCacheConfig`` sizing
    knobs. Raises ConfigError (bad or unknown knob) or ValueError (bad geometry).
    """
    derived = dict(derived or {})
    bad = (set(overrides) | set(derived)) - set(PREFIX_CACHE_KNOBS)
    if bad:
        raise ConfigError(f"load_prefix_cache_config: {', '.join(sorted(bad))} not a prefix-cache knob "
                          f"(those are {', '.join(PREFIX_CACHE_KNOBS)})")
    r = resolve("client", overrides, env=env, config_file=config_file, names=PREFIX_CACHE_KNOBS,
                given_as="keyword")
    values, sources = dict(r.values), dict(r.sources)
    for name, raw in derived.items():
        if r.sources[name] == "default" and raw is not None:
            sources[name] = "derived from the engine"
            values[name] = convert(BY_NAME[name], raw, sources[name])
    try:
        return PrefixCacheConfig(num_blocks=num_blocks, block_size=block_size, **values)
    except ValueError as exc:  # a rule across knobs (each one was checked alone): say where each came from
        given = [f"{name} from {sources[name]}" for name in PREFIX_CACHE_KNOBS if sources[name] != "default"]
        raise ConfigError(f"{exc}" + (f" ({'; '.join(given)})" if given else "")) from None


# ---------------------------------------------------------------- documentation


def markdown_table() -> str:
    """The configuration table of README.md (generated: ``python -m omnishm.config``)."""
    lines = ["| knob (TOML key) | flag | environment | default | applies to | meaning |",
             "|---|---|---|---|---|---|"]
    for k in KNOBS:
        default = k.default_doc or ("unset" if k.default is None else
                                    str(k.default).lower() if isinstance(k.default, bool) else str(k.default))
        env = f"`{k.env}`" + "".join(f" (or `{a}`)" for a in k.env_aliases)
        rule = ""
        if k.min is not None:
            rule = f"; {'>' if k.min_exclusive else '>='} {k.min:g}" + (f", <= {k.max:g}" if k.max is not None else "")
        lines.append(f"| `{k.name}` | `{k.flag}` | {env} | `{default}` | {k.scope} | {k.help}{rule} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
