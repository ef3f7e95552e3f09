"""app/config.py: every setting named, settable from the command line and the environment, documented."""

import re

import pytest

from app import ROOT
from app.__main__ import build_config
from app.config import ServerConfig, from_environment, parse_setting, settings
from core.errors import InvalidParameter

DOC = (ROOT / "docs" / "settings.md").read_text()


def documented() -> dict[str, str]:
    return {m.group(1): m.group(2).strip("`") for m in re.finditer(r"^\| `([a-z_0-9]+)` \| ([^|]+?) \|", DOC, re.M)}


def test_the_docs_list_every_setting_with_its_default():
    doc = documented()
    assert set(doc) == set(settings()), set(doc) ^ set(settings())
    for name, (_, default) in settings().items():
        shown = doc[name]
        if default in ("", None):
            assert shown in ("(empty)", "None"), (name, shown)
        elif hasattr(default, "value"):
            assert shown == default.value, (name, shown)
        else:
            assert shown == str(default), (name, shown, default)


def test_settings_from_the_environment():
    env = {"SENDLENS_MAX_CONNECTIONS": "32", "SENDLENS_ENABLE_PREFIX_CACHING": "false",
           "SENDLENS_TRUSTED_HOSTS": "a.example b.example", "OTHER": "x"}
    assert from_environment(env) == {"max_connections": 32, "enable_prefix_caching": False,
                                     "trusted_hosts": "a.example b.example"}


def test_the_command_line_wins_over_the_environment(monkeypatch):
    import argparse
    monkeypatch.setenv("SENDLENS_MAX_CONNECTIONS", "32")
    monkeypatch.setenv("SENDLENS_MAX_QUEUE", "7")
    args = argparse.Namespace(model="tiny", setting=[["max_connections", "5"], ["block_size", "32"]])
    cfg = build_config(args)
    assert cfg.max_connections == 5 and cfg.max_queue == 7 and cfg.engine.block_size == 32
    assert cfg.model == cfg.engine.model == "tiny"


@pytest.mark.parametrize("name,text", [("max_connections", "many"), ("enable_prefix_caching", "maybe"),
                                       ("no_such_setting", "1")])
def test_a_bad_setting_names_itself(name, text):
    with pytest.raises(InvalidParameter) as err:
        parse_setting(name, text)
    assert err.value.param == name


@pytest.mark.parametrize("field,value", [("max_connections_per_address", 0), ("idle_timeout_s", -1),
                                         ("max_queued_tokens", 0), ("trusted_hosts", "a;b"),
                                         ("allowed_origins", "'self'")])
def test_bad_values_are_refused(field, value):
    with pytest.raises(InvalidParameter) as err:
        ServerConfig(**{field: value})
    assert err.value.param == field


def test_the_server_serves_q4_1_unless_told_otherwise():
    """The library's engine defaults to fp32 (the reference); the server to the GGUF's own 4-bit
    weights, from every way a config is built, and a setting still chooses."""
    from core.config import EngineConfig, WeightFormat

    assert EngineConfig().weight_format is WeightFormat.FP32
    assert ServerConfig().engine.weight_format is WeightFormat.Q4_1
    assert ServerConfig.from_mapping({"model": "tiny"}).engine.weight_format is WeightFormat.Q4_1
    assert settings()["weight_format"][1] is WeightFormat.Q4_1
    chosen = ServerConfig.from_mapping({"weight_format": parse_setting("weight_format", "fp32")})
    assert chosen.engine.weight_format is WeightFormat.FP32
    with pytest.raises(InvalidParameter) as err:
        ServerConfig.from_mapping({"weight_format": "int3"})
    assert err.value.param == "weight_format"
