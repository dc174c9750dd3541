"""Knob precedence (flags > OMNISHM_* > TOML file > defaults) and clear errors for bad values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnishm import config as knobs
from omnishm.committer.config import build_parser, config_from_args
from omnishm.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
# A bare environment (no OMNISHM_* knob leaks in), but the packages where this interpreter finds them: a
# machine with pyzmq and friends installed under PYTHONPATH (pip install --target) needs that path too.
BARE_ENV = {"PATH": "/usr/bin:/bin",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "omnishm.toml"
    path.write_text(text)
    return path


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = write(tmp_path, 'heartbeat_s = 0.5\nheartbeat_timeout_s = 7.0\nprefault = true\nlog_level = "debug"\n'
                           'metrics_port = 9100\n')
    env = {"OMNISHM_HEARTBEAT_S": "0.25", "OMNISHM_HEARTBEAT_TIMEOUT_S": "6", "OMNISHM_CONFIG": str(path)}
    r = knobs.resolve("committer", {"heartbeat_s": "0.125"}, env=env)
    assert r["heartbeat_s"] == 0.125 and r.sources["heartbeat_s"] == "flag --heartbeat-s"  # flag beats env and file
    assert r["heartbeat_timeout_s"] == 6.0 and r.sources["heartbeat_timeout_s"] == "env OMNISHM_HEARTBEAT_TIMEOUT_S"
    assert r["prefault"] is True and r.sources["prefault"] == f"file {path}"  # file beats default
    assert r["log_level"] == "DEBUG" and r["metrics_port"] == 9100
    assert r["exit_when_idle"] is False and r.sources["exit_when_idle"] == "default"
    assert r["metrics_host"] == "127.0.0.1" and r["name"] == "default"


def test_an_empty_environment_variable_counts_as_unset(tmp_path):
    """README, Configuration: ``OMNISHM_X=`` (as a shell script's ``export OMNISHM_X=$MAYBE`` leaves it) is
    not a value to check, and lets the file's value (or the default) through."""
    path = write(tmp_path, "heartbeat_s = 0.5\n")
    env = {"OMNISHM_HEARTBEAT_S": "", "OMNISHM_LOG_LEVEL": "", "OMNISHM_CONFIG": str(path)}
    r = knobs.resolve("committer", env=env)
    assert r["heartbeat_s"] == 0.5 and r.sources["heartbeat_s"] == f"file {path}"
    assert r.sources["log_level"] == "default"
    assert knobs.resolve("committer", env={"OMNISHM_CONFIG": ""}).sources["heartbeat_s"] == "default"


def test_committer_parser_applies_precedence_and_no_flag_beats_env(tmp_path, monkeypatch):
    path = write(tmp_path, 'exit_when_idle = true\nname = "from-file"\nmetrics_port = 9100\n')
    monkeypatch.setenv("OMNISHM_METRICS_PORT", "9200")
    monkeypatch.setenv("OMNISHM_NAME", "from-env")
    args = build_parser().parse_args(["--config", str(path), "--metrics-port", "0"])
    assert args.metrics_port == 0 and args.name == "from-env" and args.exit_when_idle is True
    args = build_parser().parse_args(["--config", str(path), "--no-exit-when-idle", "--name", "flag"])
    assert args.exit_when_idle is False and args.name == "flag" and args.metrics_port == 9200
    cfg = config_from_args(args, tmp_path)
    assert cfg.endpoint == f"ipc://{tmp_path / 'flag.sock'}" and cfg.metrics_port == 9200


def test_exit_with_parent_watches_the_parent_unless_autostarted(tmp_path, monkeypatch):
    """``--exit-with-parent`` (or its variable) records this process's parent; an autostarted committer
    (``--spawned-by``) ignores it: its parent is the shell that detached it, gone at once, and it watches the
    client that started it instead."""
    monkeypatch.setenv("OMNISHM_EXIT_WITH_PARENT", "1")
    cfg = config_from_args(build_parser().parse_args(["--name", "p"]), tmp_path)
    assert cfg.parent_pid == os.getppid() != 0
    cfg = config_from_args(build_parser().parse_args(["--name", "p", "--spawned-by", "123"]), tmp_path)
    assert cfg.parent_pid == 0 and cfg.spawned_by == 123
    cfg = config_from_args(build_parser().parse_args(["--name", "p", "--no-exit-with-parent"]), tmp_path)
    assert cfg.parent_pid == 0
    cfg = config_from_args(build_parser().parse_args(["--name", "p", "--parent-pid", "4321"]), tmp_path)
    assert cfg.parent_pid == 4321  # the launcher's own pid, named: a parent gone before this is caught too
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--name", "p", "--parent-pid", "0"])


def test_client_settings_and_prefix_cache_config_read_env_and_file(tmp_path):
    path = write(tmp_path, "staging_depth = 6\nstaging_claim_timeout_s = 2.5\ncommit_timeout_s = 9\n"
                           "autostart = false\n")
    env = {"OMNISHM_CONFIG": str(path), "OMNISHM_STAGING_DEPTH": "8", "OMNISHM_CACHE": "legacy-name"}
    cfg = knobs.load_prefix_cache_config(16, 4, env=env, derived={"staging_capacity_tokens": 512})
    assert (cfg.num_blocks, cfg.block_size, cfg.staging_depth) == (16, 4, 8)  # env beats file
    assert cfg.staging_claim_timeout_s == 2.5 and cfg.commit_timeout_s == 9.0
    assert cfg.staging_capacity_tokens == 512  # derived replaces the built-in default only
    env["OMNISHM_STAGING_CAPACITY_TOKENS"] = "1024"
    assert knobs.load_prefix_cache_config(16, 4, env=env, derived={"staging_capacity_tokens": 512}) \
        .staging_capacity_tokens == 1024
    assert knobs.load_prefix_cache_config(16, 4, env=env, staging_depth=2).staging_depth == 2  # override wins
    s = knobs.client_settings(env=env)
    assert s.name == "legacy-name" and s.autostart is False
    assert s.manager_kwargs()["cache"] == "legacy-name"
    env["OMNISHM_NAME"] = "primary"  # the primary variable beats its alias
    assert knobs.client_settings(env=env).name == "primary"


@pytest.mark.parametrize("flags,env,file_text,message", [
    ({"heartbeat_s": "fast"}, {}, "", "bad heartbeat_s = 'fast' (from flag --heartbeat-s): expected a number"),
    ({}, {"OMNISHM_HEARTBEAT_S": "0"}, "", "bad heartbeat_s = '0' (from env OMNISHM_HEARTBEAT_S): must be >= 0.01"),
    ({}, {"OMNISHM_HEARTBEAT_TIMEOUT_S": "nan"}, "", "heartbeat_timeout_s = 'nan' (from env "
     "OMNISHM_HEARTBEAT_TIMEOUT_S): expected a finite number"),
    ({"heartbeat_s": "inf"}, {}, "", "expected a finite number"),
    ({}, {"OMNISHM_COMMIT_TIMEOUT_S": "1e10"}, "", "bad commit_timeout_s = '1e10' (from env "
     "OMNISHM_COMMIT_TIMEOUT_S): must be <= 1e+06"),  # a review's: accepted, then shutdown's join overflowed
    ({}, {"OMNISHM_METRICS_PORT": "70000"}, "", "must be <= 65535"),
    ({}, {"OMNISHM_METRICS_PORT": "1.5"}, "", "expected an integer"),
    ({"metrics_host": "0.0.0.0"}, {}, "", "metrics are served on loopback only"),
    ({}, {}, 'endpoint = "tcp://10.0.0.1:5555"\n', "tcp is allowed only on loopback"),
    # A review's: the committer took "@x" for a file in its working directory, removed one, then crashed.
    ({"endpoint": "ipc://@x"}, {}, "", "abstract ipc sockets have no file permissions"),
    # REVIEW (2026-12-06): forms ZeroMQ cannot connect to passed, and a client's connect raised a bare ZMQError;
    # port 0 bound a random port no client could know.
    ({"endpoint": "tcp://127.0.0.1:5599/x"}, {}, "", "use tcp://HOST:PORT, with no user, path or query"),
    ({"endpoint": "tcp://me@127.0.0.1:5598"}, {}, "", "use tcp://HOST:PORT, with no user, path or query"),
    ({"endpoint": "tcp://127.0.0.1:5597?a=b"}, {}, "", "use tcp://HOST:PORT, with no user, path or query"),
    ({"endpoint": "tcp://127.0.0.1:0"}, {}, "", "port 0 binds a port no client knows"),
    # Mutation review (2026-12-06): urlsplit drops a newline, tab or carriage return before it parses, so these
    # passed, and a client's connect raised a bare ZMQError (a YAML block value leaves the newline).
    ({}, {"OMNISHM_ENDPOINT": "tcp://127.0.0.1:5555\n"}, "", "has a control character"),
    ({"endpoint": "tcp://127.0.0.1:5\t555"}, {}, "", "has a control character"),
    ({"endpoint": "tcp://127.0.0.1:5555\r"}, {}, "", "has a control character"),
    ({"endpoint": "ipc:///tmp/x.sock\n"}, {}, "", "has a control character"),
    ({}, {}, "staging_depth = 0\n", "bad staging_depth = 0 (from file"),
    ({}, {}, 'prefault = "maybe"\n', "expected a boolean"),
    ({}, {}, "staging_dpeth = 3\n", "unknown key 'staging_dpeth' (did you mean 'staging_depth'?)"),
    ({}, {}, "staging_depth = [\n", "not valid TOML"),
    ({}, {"OMNISHM_LOG_LEVEL": "chatty"}, "", "use one of DEBUG, INFO"),
    ({}, {"OMNISHM_NAME": "has space"}, "", "use 1-64 letters"),
    # Mutation review (stop 47): "$" with match also matched before a final newline, so "abc\n" was a name.
    ({}, {"OMNISHM_NAME": "abc\n"}, "", "use 1-64 letters"),
    ({}, {"OMNISHM_NAME": "n" * 65}, "", "use 1-64 letters"),
    ({}, {"OMNISHM_METRICS_PORT": "65536"}, "", "bad metrics_port = '65536' (from env OMNISHM_METRICS_PORT): "
                                                "must be <= 65535"),
    ({}, {"OMNISHM_COMMIT_TIMEOUT_S": "1000000.5"}, "", "must be <= 1e+06"),
    ({"heartbeat_s": "5", "heartbeat_timeout_s": "1"}, {}, "", "idle clients would be reaped"),
    # REVIEW (2026-12-05, stop 42): a timeout of one period passed, and reaped every idle client (its beats come a
    # little more than a period apart), a writer's staging with it, and the writer's resume was refused.
    ({"heartbeat_s": "1", "heartbeat_timeout_s": "1"}, {}, "", "is under two heartbeat_s = 1"),
    ({"heartbeat_s": "1", "heartbeat_timeout_s": "1.5"}, {}, "", "is under two heartbeat_s = 1"),
    # REVIEW (2026-12-07, stop 54): beats of 1 us and a 2 us timeout passed every check, and the committer reaped
    # every client, a live writer's staging with it (0.1 s beats, 0.2 s timeout: in 2 runs of 2).
    ({"heartbeat_s": "0.000001", "heartbeat_timeout_s": "0.000002"}, {}, "", "must be >= 0.01"),
    ({"heartbeat_s": "0.1", "heartbeat_timeout_s": "0.2"}, {}, "",
     "bad heartbeat_timeout_s = '0.2' (from flag --heartbeat-timeout-s): must be >= 1"),
    # A runtime dir of whitespace was a directory " " under whatever directory a process started in.
    ({}, {"OMNISHM_RUNTIME_DIR": " "}, "", "bad runtime_dir = ' ' (from env OMNISHM_RUNTIME_DIR): expected a "
                                           "non-empty path"),
    ({}, {"OMNISHM_RUNTIME_DIR": "/tmp/x "}, "", "a path with leading or trailing whitespace"),
    # A socket path over sun_path's 107 bytes: the committer failed its bind after it made a segment.
    ({"endpoint": "ipc:///tmp/" + "d" * 98 + ".sock"}, {}, "", "its socket path is 108 bytes, over the 107 a unix "
                                                              "socket address holds"),
    # ... and one of whitespace bound a socket named " " in the working directory
    ({}, {"OMNISHM_ENDPOINT": "ipc:// "}, "", "its socket path has leading or trailing whitespace"),
    ({"endpoint": "ipc:///tmp/x.sock "}, {}, "", "its socket path has leading or trailing whitespace"),
])
def test_bad_values_raise_clear_errors(tmp_path, flags, env, file_text, message):
    env = dict(env)
    if file_text:
        env["OMNISHM_CONFIG"] = str(write(tmp_path, file_text))
    with pytest.raises(ConfigError) as exc:
        knobs.resolve("both", flags, env=env)
    assert message in str(exc.value)


def test_the_bounds_themselves_are_taken():
    """An inclusive bound is a value a user may give: a 64-character name, port 65535, the longest timeout (the
    values one past them are refused above; mutation review, stop 47)."""
    assert knobs.resolve("both", env={"OMNISHM_NAME": "n" * 64})["name"] == "n" * 64
    assert knobs.resolve("committer", env={"OMNISHM_METRICS_PORT": "65535"})["metrics_port"] == 65535
    assert knobs.resolve("client", env={"OMNISHM_COMMIT_TIMEOUT_S": "1e6"})["commit_timeout_s"] == 1e6
    beats = knobs.resolve("committer", {"heartbeat_s": "0.01", "heartbeat_timeout_s": "1"})
    assert (beats["heartbeat_s"], beats["heartbeat_timeout_s"]) == (0.01, 1.0)
    longest = "ipc:///tmp/" + "d" * 97 + ".sock"  # 107 bytes of path
    assert knobs.resolve("both", {"endpoint": longest})["endpoint"] == longest


def test_staging_and_slots_past_what_a_committer_takes_are_refused_before_attach_naming_the_knobs():
    """REVIEW (2026-12-07, stop 54): ``OMNISHM_STAGING_DEPTH=1e20`` raised a bare ``OverflowError`` encoding the
    Hello; 1e12 was refused by the committer at attach naming neither knob. A slot count past the committer's
    bound allocated the client's pin counts before anything refused it."""
    from omnishm.interface import MAX_SLOTS, MAX_STAGING_ROWS, PrefixCacheConfig

    for value in (10**20, 10**12):
        with pytest.raises(ConfigError) as exc:
            knobs.load_prefix_cache_config(16, 4, env={"OMNISHM_STAGING_DEPTH": str(value)})
        assert f"exceeds {MAX_STAGING_ROWS}" in str(exc.value), exc.value
        assert "staging_depth from env OMNISHM_STAGING_DEPTH" in str(exc.value), exc.value
    with pytest.raises(ConfigError, match="staging_capacity_tokens from keyword staging_capacity_tokens="):
        knobs.load_prefix_cache_config(16, 4, staging_capacity_tokens=MAX_STAGING_ROWS)
    cap = MAX_STAGING_ROWS // 5
    assert knobs.load_prefix_cache_config(16, 4, staging_depth=4, staging_capacity_tokens=cap).staging_depth == 4
    with pytest.raises(ValueError, match=f"exceeds {MAX_SLOTS} slots"):
        PrefixCacheConfig(num_blocks=MAX_SLOTS, block_size=2)
    assert PrefixCacheConfig(num_blocks=MAX_SLOTS // 16, block_size=16).num_slots == MAX_SLOTS


def test_a_runtime_dir_whose_socket_path_is_too_long_is_a_config_error_naming_it(tmp_path):
    """REVIEW (2026-12-07, stop 54): a client given such a runtime dir raised a bare ``zmq.ZMQError: File name too
    long``, naming neither the dir nor the endpoint. It is a ``ConfigError`` naming both now, before anything is
    made (the dir, an autostarted committer)."""
    from manager_helpers import small_config

    from omnishm.client import OmniPrefixCacheManager

    long_dir = tmp_path / ("d" * 110)
    with pytest.raises(ConfigError) as exc:
        OmniPrefixCacheManager(small_config(), cache="toolong", runtime_dir=long_dir, autostart=True,
                               connect_timeout_s=5)
    assert f"runtime_dir {str(long_dir)!r} for cache 'toolong'" in str(exc.value), exc.value
    assert "over the 107 a unix socket address holds" in str(exc.value), exc.value
    assert not long_dir.exists()


def test_the_config_flag_names_the_file_over_omnishm_config(tmp_path, monkeypatch):
    """README, Configuration: the TOML file is ``--config FILE``, else ``$OMNISHM_CONFIG``. A ``--config`` is the
    file read even when ``OMNISHM_CONFIG`` names another (or one that does not exist), and each value's source
    names it (mutation review, stop 47: the environment's file winning survived)."""
    from omnishm.committer.config import build_parser

    env_file, flag_file = tmp_path / "env.toml", tmp_path / "flag.toml"
    env_file.write_text('name = "from-env-file"\nmetrics_port = 9101\n')
    flag_file.write_text('name = "from-flag-file"\n')
    r = knobs.resolve("committer", env={"OMNISHM_CONFIG": str(env_file)}, config_file=flag_file)
    assert r["name"] == "from-flag-file" and r.sources["name"] == f"file {flag_file}"
    assert r["metrics_port"] == 0 and r.sources["metrics_port"] == "default"
    monkeypatch.setenv("OMNISHM_CONFIG", str(tmp_path / "missing.toml"))
    args = build_parser().parse_args(["--config", str(flag_file)])
    assert args.name == "from-flag-file" and args.sources["name"] == f"file {flag_file}"


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    """REVIEW (2026-12-05, stop 42, CLI): tomllib raises UnicodeDecodeError for bytes that are not UTF-8, and every
    command ended in a traceback (exit 1, not 2)."""
    path = tmp_path / "omnishm.toml"
    path.write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        knobs.resolve("both", {}, env={"OMNISHM_CONFIG": str(path)})


def test_a_bad_file_value_is_reported_even_when_env_overrides_it(tmp_path):
    env = {"OMNISHM_CONFIG": str(write(tmp_path, "staging_depth = -1\n")), "OMNISHM_STAGING_DEPTH": "4"}
    with pytest.raises(ConfigError, match="staging_depth = -1"):
        knobs.client_settings(env=env)


def test_missing_config_file_and_unknown_override():
    with pytest.raises(ConfigError, match="cannot read it"):
        knobs.resolve("committer", env={"OMNISHM_CONFIG": "/nonexistent/omnishm.toml"})
    with pytest.raises(ConfigError, match="not a prefix-cache knob"):
        knobs.load_prefix_cache_config(4, 4, env={}, heartbeat_s=1.0)


def test_committer_refuses_bad_value_with_exit_2_before_creating_anything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "omnishm.committer", "--name", "cfgbad", "--runtime-dir",
                           str(tmp_path), "--metrics-host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=30, cwd=REPO,
                          env=BARE_ENV)
    assert proc.returncode == 2
    assert "bad metrics_host = '0.0.0.0' (from flag --metrics-host)" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no lock, socket or segment made


def test_every_knob_is_in_the_readme_table():
    table = knobs.markdown_table()
    doc = (REPO / "README.md").read_text()
    assert table in doc, "README.md's configuration table is stale: paste `python -m omnishm.config` into it"
    for k in knobs.KNOBS:
        assert f"`{k.env}`" in table and f"`{k.flag}`" in table
    assert {"staging_depth", "metrics_port", "metrics_host", "log_level", "autostart"} <= set(knobs.BY_NAME)


def test_a_manager_built_directly_takes_the_connection_knobs_from_the_environment(committer_factory, monkeypatch):
    """``OmniPrefixCacheManager(config)`` with no connection arguments reads OMNISHM_NAME, OMNISHM_AUTOSTART and
    OMNISHM_CONNECT_TIMEOUT_S (it used to ignore all but OMNISHM_RUNTIME_DIR); explicit arguments still win."""
    from conftest import RUNTIME_DIR, unique_cache_name
    from manager_helpers import small_config

    from omnishm import liveness, shm
    from omnishm.client import OmniPrefixCacheManager
    from omnishm.interface import OmniPrefixCacheCommitterError

    absent = unique_cache_name("noenv")
    monkeypatch.setenv("OMNISHM_NAME", absent)
    monkeypatch.setenv("OMNISHM_AUTOSTART", "0")
    monkeypatch.setenv("OMNISHM_CONNECT_TIMEOUT_S", "0.5")
    with pytest.raises(OmniPrefixCacheCommitterError, match=absent):
        OmniPrefixCacheManager(small_config())
    assert not liveness.lock_path(RUNTIME_DIR, absent).exists() and shm.list_segments(absent) == []  # none started

    handle = committer_factory()
    monkeypatch.setenv("OMNISHM_NAME", handle.name)
    with OmniPrefixCacheManager(small_config()) as m:
        assert m.cache == handle.name
    monkeypatch.setenv("OMNISHM_CONNECT_TIMEOUT_S", "-1")
    with pytest.raises(ConfigError, match="OMNISHM_CONNECT_TIMEOUT_S"):
        OmniPrefixCacheManager(small_config())
    with OmniPrefixCacheManager(small_config(), cache=handle.name, autostart=False, connect_timeout_s=5.0,
                                endpoint=handle.endpoint, runtime_dir=RUNTIME_DIR) as m:  # nothing read
        assert m.cache == handle.name


def test_manager_connection_reads_only_the_missing_knobs(monkeypatch):
    """A bad value of a knob the manager does not read now (sizing, the vLLM extension's, or the name when
    ``cache`` is given) does not stop it; an explicit cache keeps its own socket over OMNISHM_ENDPOINT."""
    monkeypatch.setenv("OMNISHM_STAGING_DEPTH", "0")
    monkeypatch.setenv("OMNISHM_VLLM_HELD_BYTES", "1GiB")
    monkeypatch.setenv("OMNISHM_NAME", "bad/name")
    monkeypatch.setenv("OMNISHM_ENDPOINT", "ipc:///tmp/elsewhere/stageA.sock")
    got = knobs.manager_connection(cache="stageB", endpoint=None, autostart=None, runtime_dir=None,
                                   connect_timeout_s=None)
    assert {k: v for k, v in got.items() if k != "runtime_dir"} == {"cache": "stageB", "endpoint": None,
                                                                    "autostart": True, "connect_timeout_s": 30.0}
    with pytest.raises(ConfigError, match="OMNISHM_NAME"):  # read when the cache is left out
        knobs.manager_connection(cache=None, endpoint=None, autostart=False, runtime_dir=None, connect_timeout_s=1.0)
    monkeypatch.setenv("OMNISHM_NAME", "stageA")
    got = knobs.manager_connection(cache=None, endpoint=None, autostart=False, runtime_dir=None, connect_timeout_s=1.0)
    assert got["cache"] == "stageA" and got["endpoint"] == "ipc:///tmp/elsewhere/stageA.sock"


@pytest.mark.parametrize("given, message", [
    ({"endpoint": "tcp://10.1.1.1:5555"}, r"endpoint.*tcp is allowed only on loopback"),
    ({"connect_timeout_s": -1.0}, r"connect_timeout_s.*must be > 0"),
    ({"connect_timeout_s": float("nan")}, r"connect_timeout_s.*finite"),
])
def test_manager_connection_checks_the_arguments_it_is_given(given, message):
    """README: every value is checked, the keyword override too; the trust model: tcp only on loopback.
    A manager given a routable tcp endpoint must refuse it at once, not send its Hello there for 30 s."""
    args = {"cache": "stageB", "endpoint": None, "autostart": False, "runtime_dir": None, "connect_timeout_s": 1.0}
    with pytest.raises(knobs.ConfigError, match=message):
        knobs.manager_connection(**{**args, **given})


def test_committer_refuses_a_runtime_dir_it_cannot_create_with_exit_2_and_no_traceback(tmp_path):
    """Exit 2 names a refused start (bad options); a runtime dir under a file (or on a read-only or
    missing mount) is one: a message naming the directory, not a traceback with exit 1."""
    (tmp_path / "a-file").write_text("")
    proc = subprocess.run([sys.executable, "-m", "omnishm.committer", "--name", "cfgbad", "--runtime-dir",
                           str(tmp_path / "a-file" / "rt")],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=BARE_ENV)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "omnishm committer:" in proc.stderr and "a-file" in proc.stderr


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e10])
def test_prefix_cache_config_refuses_non_finite_timeouts(value):
    """The knob path refuses them ("nan passes every bound check, inf makes a deadline that never
    comes"); a PrefixCacheConfig built directly, which the manager takes as given, must too."""
    from omnishm.interface import PrefixCacheConfig

    with pytest.raises(ValueError, match="commit_timeout_s"):
        PrefixCacheConfig(num_blocks=16, block_size=4, commit_timeout_s=value)


def test_a_keyword_override_is_named_as_a_keyword_and_a_leading_zero_is_decimal():
    """REVIEW (2026-12-06): a keyword override of ``load_prefix_cache_config`` or ``client_settings`` was
    reported as a command-line flag nobody gave ("from flag --staging-depth"); and "08" was refused as "expected
    an integer" (base 0 refuses a leading zero), while 0x/0o/0b forms are still read."""
    with pytest.raises(ConfigError, match=r"bad staging_depth = 0 \(from keyword staging_depth=\)"):
        knobs.load_prefix_cache_config(8, 4, env={}, staging_depth=0)
    with pytest.raises(ConfigError, match=r"\(from keyword autostart=\)"):
        knobs.client_settings(env={}, autostart="maybe")
    for text, value in (("08", 8), ("010", 10), ("0x10", 16), ("0o10", 8), ("1_000", 1000)):
        assert knobs.resolve("client", env={"OMNISHM_STAGING_DEPTH": text}, names=("staging_depth",))[
            "staging_depth"] == value, text


def test_an_admin_request_to_an_endpoint_zeromq_refuses_is_unavailable_not_a_traceback():
    """REVIEW (2026-12-06): ``omnishm ping``/``status`` connected without a guard, and an endpoint ZeroMQ refuses
    printed a ZMQError traceback. ``check_endpoint`` refuses those forms now; the connect is guarded too."""
    from omnishm.cli import CommitterUnavailable, admin_request

    with pytest.raises(CommitterUnavailable, match="cannot connect to tcp://127.0.0.1:5599/x"):
        admin_request("x", "tcp://127.0.0.1:5599/x", None, timeout_s=1.0)


def test_a_knob_of_the_other_side_given_to_client_settings_is_refused_not_dropped():
    """Mutation review (2026-12-06): ``client_settings(**overrides)`` took a committer knob, a bad value too, and
    dropped it without a word (``client_settings(heartbeat_s="fast")`` returned normally): the caller believed
    it set something. A knob a client never reads is refused, naming where it is read."""
    with pytest.raises(ConfigError, match=r"heartbeat_s: not read by a client \(a committer knob\)"):
        knobs.client_settings(env={}, heartbeat_s="fast")
    with pytest.raises(ConfigError, match="metrics_port: not read by a client"):
        knobs.client_settings(env={}, metrics_port=9100)
    assert knobs.client_settings(env={}, name="fine").name == "fine"  # a client knob, as before


def test_a_misspelt_override_is_refused_naming_it():
    """Mutation review (2026-12-06): ``client_settings(**overrides)`` and ``resolve(flags=...)`` raise ``ConfigError`` naming an override that
    is no knob (README, Configuration: every value is checked; bad input gets a clear error): a typo such as
    ``staging_dpeth=8`` silently left the depth at its default before anyone noticed."""
    with pytest.raises(knobs.ConfigError, match="unknown knob.*staging_dpeth"):
        knobs.client_settings(env={}, staging_dpeth=8)
    with pytest.raises(knobs.ConfigError, match="unknown knob.*heartbeat_sec"):
        knobs.resolve("committer", {"heartbeat_sec": "1"}, env={})
    assert knobs.client_settings(env={}, staging_depth=8).prefix_cache["staging_depth"] == 8


# MUTATION D5 (interface.PrefixCacheConfig: ``staging_depth * cap`` for ``(staging_depth + 1) * cap``): the
# writer's Hello carries ``staging_depth * cap + cap`` rows (``OmniPrefixCacheManager``), so a config whose rows
# pass the mutated bound but exceed MAX_STAGING_ROWS got past the config and was refused by the committer at
# attach naming neither knob. The exact boundary must be accepted, one more row refused. (stop 54)
def test_the_staging_bound_counts_the_extra_page():
    from omnishm.interface import MAX_STAGING_ROWS, PrefixCacheConfig

    half = MAX_STAGING_ROWS // 2
    ok = PrefixCacheConfig(num_blocks=16, block_size=4, staging_depth=1, staging_capacity_tokens=half)
    assert (ok.staging_depth + 1) * ok.staging_capacity_tokens == MAX_STAGING_ROWS  # exactly the bound: taken
    with pytest.raises(ValueError, match=f"exceeds {MAX_STAGING_ROWS}"):
        PrefixCacheConfig(num_blocks=16, block_size=4, staging_depth=1, staging_capacity_tokens=half + 1)
    with pytest.raises(ConfigError, match="staging_capacity_tokens"):
        knobs.load_prefix_cache_config(16, 4, staging_depth=1, staging_capacity_tokens=half + 1)


def test_a_runtime_dir_whose_socket_path_is_too_long_is_refused_before_it_is_made(tmp_path):
    """REVIEW (2026-12-07, stop 54): the committer refused such a dir (exit 2) after it had made it, and the demo
    made it, started its ranks, and reported them FAILED with exit 1 where other config errors exit 2."""
    long_dir = tmp_path / ("d" * 110)
    for argv in (["-m", "omnishm.committer", "--name", "toolong", "--runtime-dir", str(long_dir)],
                 ["-m", "omnishm", "demo", "--tp", "1", "--steps", "2", "--name", "toolong"]):
        env = {**os.environ, "OMNISHM_RUNTIME_DIR": str(long_dir)}
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "over the 107 a unix socket address holds" in proc.stderr and "Traceback" not in proc.stderr, \
            proc.stderr
        assert not long_dir.exists(), argv


# Mutation review (stop 54): check_endpoint's whitespace rule is "leading or trailing"; only trailing was tested
# (``ipc:// `` and ``ipc:///tmp/x.sock ``), so a check that ran ``rstrip`` passed the suite. ``ipc:// /tmp/x.sock``
# names a socket `` /tmp/x.sock`` relative to the working directory.
@pytest.mark.parametrize("endpoint", ["ipc:// /tmp/x.sock", "ipc://   x.sock"])
def test_an_ipc_path_with_leading_whitespace_is_refused(endpoint):
    from omnishm.config import check_endpoint

    with pytest.raises(ValueError, match="leading or trailing whitespace"):
        check_endpoint(endpoint)
    with pytest.raises(ConfigError, match="leading or trailing whitespace"):
        knobs.resolve("both", {}, env={"OMNISHM_ENDPOINT": endpoint})


def test_a_committer_given_one_exits_2_before_it_makes_anything(tmp_path):
    rt = tmp_path / "rt"
    proc = subprocess.run([sys.executable, "-m", "omnishm.committer", "--name", "lws", "--runtime-dir", str(rt),
                           "--endpoint", "ipc:// " + str(tmp_path / "c.sock")], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "leading or trailing whitespace" in proc.stderr and "Traceback" not in proc.stderr
    assert not rt.exists() and not (tmp_path / " ").exists()


# Mutation review (stop 54): the committer checks the socket path of the runtime dir it was *given by flag* before
# it makes that dir. The suite gave the long dir through OMNISHM_RUNTIME_DIR as well, so a check of the default
# dir's socket (``paths.ipc_endpoint(None, ...)``) passed it, and a ``--runtime-dir`` too long for a socket was
# made, and left, before the refusal.
def test_a_runtime_dir_flag_whose_socket_path_is_too_long_is_refused_before_it_is_made(tmp_path):
    long_dir = tmp_path / ("d" * 110)
    env = {k: v for k, v in os.environ.items() if k not in ("OMNISHM_RUNTIME_DIR", "OMNISHM_ENDPOINT")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "xdg")  # the default dir: short, and not the one given
    proc = subprocess.run([sys.executable, "-m", "omnishm.committer", "--name", "toolongflag", "--runtime-dir",
                           str(long_dir)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "over the 107 a unix socket address holds" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not long_dir.exists()
    assert not (tmp_path / "xdg").exists()
