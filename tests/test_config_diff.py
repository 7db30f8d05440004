"""The pure diff of two configs: engines added, removed, changed; keys changed or needing a restart."""

from __future__ import annotations

from pathlib import Path

from narwhal.config import parse_config
from narwhal.config_diff import RELOADABLE_KEYS, ConfigDiff, diff_configs, flat_keys, is_reloadable, merge_reloadable
from narwhal.control.reload import split_config_error

ENGINES = {
    "p1": ("http://127.0.0.1:9001", "prefill"),
    "d1": ("http://127.0.0.1:9002", "decode"),
    "d2": ("http://127.0.0.1:9003", "decode"),
}


def config(sections: str = "", engines: dict[str, tuple[str, str]] | None = None):
    text = sections + "\n"
    for name, (url, role) in (ENGINES if engines is None else engines).items():
        text += f'[[engines]]\nname = "{name}"\nurl = "{url}"\nrole = "{role}"\n'
    return parse_config(text)


def test_the_same_config_changes_nothing():
    assert diff_configs(config(), config()) == ConfigDiff()
    assert diff_configs(config(), config()).empty


def test_engines_added_and_removed_by_name_in_file_order():
    new = dict(ENGINES)
    del new["d1"]
    new["d3"] = ("http://127.0.0.1:9004", "decode")
    new["p2"] = ("http://127.0.0.1:9005", "prefill")
    diff = diff_configs(config(), config(engines=new))
    assert diff.engines_added == ["d3", "p2"]
    assert diff.engines_removed == ["d1"]
    assert diff.engines_changed == []


def test_a_changed_url_or_role_is_a_removal_plus_an_addition():
    new = dict(ENGINES)
    new["d1"] = ("http://127.0.0.1:9102", "decode")  # url
    new["d2"] = ("http://127.0.0.1:9003", "prefill")  # role
    diff = diff_configs(config(), config(engines=new))
    assert diff.engines_changed == ["d1", "d2"]
    assert diff.engines_added == ["d1", "d2"]
    assert diff.engines_removed == ["d1", "d2"]


def test_reordering_engines_is_no_change():
    reordered = dict(reversed(list(ENGINES.items())))
    assert diff_configs(config(), config(engines=reordered)).empty


def test_reloadable_keys_are_changed_and_the_others_need_a_restart():
    old = config('[serving]\nlisten = "127.0.0.1:8000"\n[recovery]\neject_after = 3\n')
    new = config('[serving]\nlisten = "127.0.0.1:8001"\nworkers = 2\n[recovery]\neject_after = 5\n'
                 '[admin]\ntoken = "t0ken"\n[handoff]\npath = "/tmp/h.json"\n'
                 '[lease]\nbackend = "file"\npath = "/tmp/lease"\n')
    diff = diff_configs(old, new)
    assert diff.keys_changed == ["admin.token", "recovery.eject_after"]
    assert diff.keys_needing_restart == ["handoff.path", "lease.backend", "lease.path", "serving.listen",
                                         "serving.workers"]
    assert not diff.empty


def test_the_restart_keys_the_issue_names_are_never_reloadable():
    for key in ("serving.listen", "serving.workers", "lease.backend", "lease.path", "handoff.path"):
        assert not is_reloadable(key), key
    for key in ("recovery.eject_after", "recovery.failure_quarantine_s", "admin.token",
                "controller.monitor_interval_s", "fleet.generation"):
        assert is_reloadable(key), key


def test_an_engine_set_change_is_listed_and_asks_for_a_restart_while_engines_are_not_reloadable():
    new = dict(ENGINES)
    new["d3"] = ("http://127.0.0.1:9004", "decode")
    diff = diff_configs(config(), config(engines=new))
    assert diff.engines_added == ["d3"]
    assert ("engines" in diff.keys_needing_restart) is ("engines" not in RELOADABLE_KEYS)


def test_merge_takes_reloadable_keys_from_the_new_file_and_keeps_the_running_values_of_the_others():
    old = config('[serving]\nlisten = "127.0.0.1:8000"\n[fleet]\ngeneration = "g1"\n')
    new_engines = dict(ENGINES)
    new_engines["d3"] = ("http://127.0.0.1:9004", "decode")
    new = config('[serving]\nlisten = "127.0.0.1:9999"\nmax_connections = 9\n[fleet]\ngeneration = "g2"\n'
                 '[recovery]\nliveness_misses = 7\n', engines=new_engines)
    merged = merge_reloadable(old, new)
    assert merged.serving == old.serving
    assert merged.fleet.generation == "g2"
    assert merged.recovery.liveness_misses == 7
    expected = new.engines if "engines" in RELOADABLE_KEYS else old.engines
    assert [spec.name for spec in merged.engines] == [spec.name for spec in expected]
    # Everything that differs after the merge is what needs a restart, nothing else.
    assert diff_configs(merged, new).keys_needing_restart == diff_configs(old, new).keys_needing_restart
    assert diff_configs(merged, new).keys_changed == []


def test_a_config_error_is_split_into_file_key_and_problem():
    error = split_config_error("/etc/n.toml: serving.listen: expected HOST:PORT, got 'x'", "/etc/n.toml")
    assert (error.file, error.key, error.problem) == ("/etc/n.toml", "serving.listen", "expected HOST:PORT, got 'x'")
    error = split_config_error("/etc/n.toml: engines[2].url: url has a bad port", "/etc/n.toml")
    assert error.key == "engines[2].url"
    error = split_config_error('/etc/n.toml: engine "d2".port: unknown key', "/etc/n.toml")
    assert (error.key, error.problem) == ('engine "d2".port', "unknown key")
    error = split_config_error("/etc/n.toml: not valid TOML: Expected '=' at line 3", "/etc/n.toml")
    assert error.key is None and error.problem == "not valid TOML: Expected '=' at line 3"


def _reload_table() -> dict[str, tuple[str, str]]:
    docs = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    section = docs.split("## Reloading: which keys change without a restart", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`["):
            rows[cells[0].strip("`[]")] = (cells[1], cells[2])
    return rows


def _names(cell: str, field: str) -> bool:
    return cell.startswith("every") or f"`{field}`" in cell


def test_docs_mark_every_key_reloadable_or_not_as_the_router_does():
    table = _reload_table()
    keys = flat_keys(config())
    assert set(table) == {key.split(".", 1)[0] for key in keys} | {"engines"}
    for key in keys:
        section, field = key.split(".", 1)
        reload_cell, restart_cell = table[section]
        if is_reloadable(key):
            assert _names(reload_cell, field) and not _names(restart_cell, field), key
        else:
            assert _names(restart_cell, field) and not _names(reload_cell, field), key
    assert is_reloadable("engines") is table["engines"][0].startswith("every")
