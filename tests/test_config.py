"""StoreConfig: sizes, choices, env overrides, and one clear error per bad input."""

from __future__ import annotations

import pytest

from npukv_store import ConfigError, StoreConfig, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("64MiB", 64 << 20),
        ("500GiB", 500 << 30),
        ("1.5TB", 1_500_000_000_000),
        ("2 g", 2 << 30),
        (0, 0),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["-5GiB", "lots", "5 parsecs", "1e9", "", -1, True, 1.5]
)
def test_bad_capacity_names_found_and_expected(bad):
    with pytest.raises(ConfigError, match=r"capacity: found .*expected"):
        StoreConfig.from_extra_config({"cache_dir": "/x", "capacity": bad}, env={})


def test_unknown_keys_are_listed():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) 'capcity'"):
        StoreConfig.from_extra_config({"cache_dir": "/x", "capcity": "1GiB"}, env={})


def test_missing_cache_dir():
    with pytest.raises(ConfigError, match="cache_dir: missing"):
        StoreConfig.from_extra_config({"capacity": "1GiB"}, env={})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("io_engine", "spdk"),
        ("fsync", "sometimes"),
        ("verify", "maybe"),
        ("layerwise", "yes"),
        ("direct_io", "perhaps"),
        ("prefetch_depth", "0"),
        ("prefetch_depth", "two"),
        ("evict_grace_s", "-1"),
        ("index_map_size", "1KiB"),
        ("load_policy", "never"),
        ("load_margin", "-0.1"),
        ("load_margin", "nan"),
        ("load_margin", "lots"),
    ],
)
def test_bad_values(key, value):
    with pytest.raises(ConfigError, match=rf"{key}: found"):
        StoreConfig.from_extra_config({"cache_dir": "/x", key: value}, env={})


def test_env_overrides_extra_config_and_strings_parse():
    config = StoreConfig.from_extra_config(
        {"cache_dir": "/x", "capacity": "1GiB", "direct_io": "true"},
        env={"NPUKV_CAPACITY": "2GiB", "NPUKV_IO_ENGINE": "Threads"},
    )
    assert config.capacity == 2 << 30
    assert config.io_engine == "threads"
    assert config.direct_io is True


def test_every_design_key_exists():
    design = {
        "cache_dir", "capacity", "ring_size", "chunk_target_size", "io_engine",
        "direct_io", "fsync", "verify", "layerwise", "prefetch_depth",
        "save_decode", "namespace_extra",
    }  # fmt: skip
    assert design <= set(StoreConfig.keys())


def test_mooncake_segment_is_none_or_at_least_16mib():
    for size in (0, "16MiB", "1GiB"):
        StoreConfig(cache_dir="/x", mooncake_segment_size=size)
    with pytest.raises(ConfigError, match="found 8388608 bytes, expected 0 or >="):
        StoreConfig(cache_dir="/x", mooncake_segment_size="8MiB")


def test_remote_store_mooncake_needs_a_master_address():
    with pytest.raises(ConfigError, match="mooncake_master: found ''"):
        StoreConfig(cache_dir="/x", remote_store="mooncake")
    cfg = StoreConfig(
        cache_dir="/x", remote_store="Mooncake", mooncake_master=" 10.0.0.5:50051 "
    )
    assert (cfg.remote_store, cfg.mooncake_master) == ("mooncake", "10.0.0.5:50051")


def test_tenant_shares_take_fractions_percentages_and_sizes():
    config = StoreConfig(
        cache_dir="/x", capacity="100GiB",
        tenant_shares={"a": 0.25, "b": "10%", "": "20GiB", "c": "0.05"},
    )  # fmt: skip
    assert config.tenant_shares == (
        ("a", 0.25), ("b", 0.1), ("", 20 << 30), ("c", 0.05),
    )  # fmt: skip
    from_env = StoreConfig.from_extra_config(
        {"cache_dir": "/x"}, env={"NPUKV_TENANT_SHARES": '{"a": 0.5}'}
    )
    assert from_env.tenant_shares == (("a", 0.5),)


@pytest.mark.parametrize(
    ("shares", "fragment"),
    [
        ({"a": 1.5}, "tenant_shares['a']: found 1.5, expected a fraction in (0, 1]"),
        ({"a": "0%"}, "tenant_shares['a']: found '0%'"),
        ({"a": 0}, "tenant_shares['a']: found 0, expected a share > 0"),
        ({"a": "200GiB"}, "adding up to 200% of capacity"),
        ("not json", "tenant_shares: found 'not json', expected a JSON object"),
        ({1: 0.5}, "tenant_shares: found salt 1, expected a string"),
    ],
)
def test_bad_tenant_shares_are_one_clear_error(shares, fragment):
    with pytest.raises(ConfigError) as caught:
        StoreConfig(cache_dir="/x", capacity="100GiB", tenant_shares=shares)
    assert fragment in str(caught.value)
