"""docs/guide/configuration.md is current, and what it says of each key is true.

The page is rendered from StoreConfig's field metadata; these tests fail when the
committed page differs from the render, and when the metadata the render reads
(choices, sizes, environment variables) disagrees with what StoreConfig accepts.
"""

import dataclasses

import pytest

from npukv_store import config_reference
from npukv_store.config import StoreConfig, parse_size
from npukv_store.errors import ConfigError

FIELDS = {f.name: f for f in dataclasses.fields(StoreConfig)}


def test_committed_page_is_current():
    page = config_reference.PAGE
    committed = page.read_text(encoding="utf-8") if page.exists() else ""
    assert committed == config_reference.render(), (
        f"{page.relative_to(config_reference.REPO)} is stale: regenerate it with "
        f"`{config_reference.REGENERATE}`"
    )


def test_every_key_has_a_doc_and_a_section():
    sections = {name for name, _, _ in config_reference.SECTIONS}
    for name, field in FIELDS.items():
        assert field.metadata["doc"].strip(), name
        assert field.metadata["section"] in sections, name


@pytest.mark.parametrize(
    "name", [n for n, f in FIELDS.items() if f.metadata["choices"]]
)
def test_choices_are_exactly_what_the_config_accepts(name):
    choices = FIELDS[name].metadata["choices"]
    extra = {"mooncake_master": "10.0.0.5:50051"} if name == "remote_store" else {}
    for choice in choices:
        assert (
            getattr(StoreConfig(cache_dir="/x", **extra, **{name: choice}), name)
            == choice
        )
    with pytest.raises(ConfigError, match="expected one of (.*)") as refused:
        StoreConfig(cache_dir="/x", **{name: "no-such-choice"})
    assert str(refused.value).endswith(f"expected one of {', '.join(choices)}")


@pytest.mark.parametrize(
    "name", [n for n, f in FIELDS.items() if f.metadata["unit"] == "bytes"]
)
def test_sizes_parse_units(name):
    assert getattr(StoreConfig(cache_dir="/x", **{name: "64MiB"}), name) == 64 << 20


@pytest.mark.parametrize("name", [n for n in FIELDS if n != "cache_dir"])
def test_env_var_overrides_with_the_documented_default(name):
    """The page's environment variable and default, given back, are the default."""
    field = FIELDS[name]
    shown = config_reference.format_default(field).strip("`")
    value = "" if shown == '""' else shown
    env = {config_reference.env_var(name): value}
    config = StoreConfig.from_extra_config({"cache_dir": "/x"}, env=env)
    expected = field.default
    if field.metadata["unit"] == "bytes":
        assert parse_size(value) == expected
    assert getattr(config, name) == expected


def test_env_var_names_the_cache_dir():
    env = {config_reference.env_var("cache_dir"): "/from/env"}
    assert StoreConfig.from_extra_config({}, env=env).cache_dir == "/from/env"


def test_write_and_print(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    assert config_reference.main(["--write", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == config_reference.render()
    assert config_reference.main([]) == 0
    assert capsys.readouterr().out == config_reference.render()
