"""OakenConfig (src/oakenkv/format/config.py): the slot width and its serialized, versioned form."""

from __future__ import annotations

import json

import pytest

from oakenkv.format.config import CONFIG_VERSION, MIDDLE_BITS_CHOICES, OakenConfig

#: What a version-1 config file has always held for the paper's defaults, key for key and in this order: a 4-bit
#: config must still serialize to exactly this (files and the cache keys derived from them stay what they were).
V1_DEFAULT = {
    "version": 1,
    "outer_ratio": 0.04,
    "inner_ratio": 0.06,
    "middle_bits": 4,
    "inner_bits": 5,
    "outer_bits": 5,
    "granularity": "token",
    "key_position": "post_rope",
    "scale_dtype": "float16",
    "chunk_size": 64,
}


def test_a_four_bit_config_is_written_as_version_1_byte_for_byte():
    assert json.dumps(OakenConfig().to_dict()) == json.dumps(V1_DEFAULT)
    assert OakenConfig.from_dict(V1_DEFAULT) == OakenConfig()
    assert OakenConfig.from_dict({k: v for k, v in V1_DEFAULT.items() if k != "version"}) == OakenConfig()


@pytest.mark.parametrize("mb", MIDDLE_BITS_CHOICES)
def test_slot_widths_round_trip(mb):
    cfg = OakenConfig(middle_bits=mb, outer_ratio=0.02, inner_ratio=0.01, scale_dtype="float32")
    assert (cfg.inner_bits, cfg.outer_bits) == (mb + 1, mb + 1)  # the COO entry's code bit by default
    d = cfg.to_dict()
    assert d["version"] == (1 if mb == 4 else 2) and d["middle_bits"] == mb
    assert list(d) == list(V1_DEFAULT)  # the same keys in the same order
    assert OakenConfig.from_dict(json.loads(json.dumps(d))) == cfg
    narrow = OakenConfig(middle_bits=mb, inner_bits=mb)
    assert OakenConfig.from_dict(narrow.to_dict()) == narrow


def test_slot_width_and_group_bits_are_validated():
    for bad in (1, 8, True, 3.0, "3"):
        with pytest.raises(ValueError, match="middle_bits"):
            OakenConfig(middle_bits=bad)
    with pytest.raises(ValueError, match="inner_bits must be 3 or 4"):
        OakenConfig(middle_bits=3, inner_bits=5)
    with pytest.raises(ValueError, match="outer_bits must be 2 or 3"):
        OakenConfig(middle_bits=2, outer_bits=4)
    with pytest.raises(ValueError, match="inner_bits must be 4 or 5"):
        OakenConfig(inner_bits=3)
    # replace carries the group widths along with the slot: replace(middle_bits=5) kept 5-bit outliers (silently a
    # bit short), replace(middle_bits=3) raised about inner_bits the caller never set
    for mb in MIDDLE_BITS_CHOICES:
        assert OakenConfig().replace(middle_bits=mb) == OakenConfig(middle_bits=mb)
        assert OakenConfig(middle_bits=mb).replace(middle_bits=4) == OakenConfig()
    narrow = OakenConfig(inner_bits=4, outer_bits=5)  # (inner codes without the COO bit)
    assert narrow.replace(middle_bits=6) == OakenConfig(middle_bits=6, inner_bits=6, outer_bits=7)
    assert OakenConfig().replace(middle_bits=3, inner_bits=3) == OakenConfig(middle_bits=3, inner_bits=3)
    with pytest.raises(ValueError, match="inner_bits must be 3 or 4"):
        OakenConfig().replace(middle_bits=3, inner_bits=5)


def test_versions_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="middle_bits must be 4 in a version-1 config"):
        OakenConfig.from_dict({**V1_DEFAULT, "middle_bits": 3, "inner_bits": 4, "outer_bits": 4})
    v2 = OakenConfig(middle_bits=3).to_dict()
    with pytest.raises(ValueError, match="must give middle_bits"):
        OakenConfig.from_dict({k: v for k, v in v2.items() if k != "middle_bits"})
    with pytest.raises(ValueError, match="chunk_size must be 64"):
        OakenConfig.from_dict({**v2, "chunk_size": 32})
    for version in (0, 5, True, "2", 3.0):
        with pytest.raises(ValueError, match="unsupported OakenConfig version"):
            OakenConfig.from_dict({**v2, "version": version})


@pytest.mark.parametrize("mb", (2, 4, 7))
def test_static_grids_are_version_3_and_off_is_unchanged(mb):
    """Off: the version-1/2 form byte for byte (no new key); on: version 3, the same keys then static_grids."""
    off = OakenConfig(middle_bits=mb)
    assert "static_grids" not in off.to_dict() and off.to_dict()["version"] == (1 if mb == 4 else 2)
    on = OakenConfig(middle_bits=mb, static_grids=True)
    d = on.to_dict()
    assert d["version"] == 3 and list(d) == [*V1_DEFAULT, "static_grids"] and d["static_grids"]
    assert OakenConfig.from_dict(json.loads(json.dumps(d))) == on
    assert OakenConfig.from_dict({**d, "static_grids": False}) == off  # a version-3 file may say off
    assert on != off and hash(on) != hash(off)


def test_static_grids_are_validated_and_versioned():
    for bad in (1, 0, "yes", None, 1.0):
        with pytest.raises(ValueError, match="static_grids must be True or False"):
            OakenConfig(static_grids=bad)
    d = OakenConfig(static_grids=True).to_dict()
    with pytest.raises(ValueError, match="static_grids must be True or False"):
        OakenConfig.from_dict({**d, "static_grids": 1})
    with pytest.raises(ValueError, match="must give static_grids"):
        OakenConfig.from_dict({k: v for k, v in d.items() if k != "static_grids"})
    for version in (1, 2):
        with pytest.raises(ValueError, match="static_grids needs a version-3"):
            OakenConfig.from_dict({**d, "version": version})


# ---------------------------------------------------------------- static levels (OakenConfig.static_levels)


@pytest.mark.parametrize("mb", (2, 4, 7))
def test_static_levels_are_version_4_and_every_older_config_is_unchanged(mb):
    """Levels: version 4, version 3's keys then static_levels; without them every config keeps its version and its
    bytes (the cache keys derived from them stay what they were)."""
    from oakenkv.format.config import DEFAULT_STATIC_LEVELS

    assert CONFIG_VERSION == 4 and DEFAULT_STATIC_LEVELS == (0.5, 0.7, 0.85, 1.0)
    for cfg, version in (
        (OakenConfig(middle_bits=mb), 1 if mb == 4 else 2),
        (OakenConfig(middle_bits=mb, static_grids=True), 3),
    ):
        d = cfg.to_dict()
        assert d["version"] == version and "static_levels" not in d
        before = {**({**V1_DEFAULT, "middle_bits": mb} if version > 1 else V1_DEFAULT)}
        if version > 1:
            before["inner_bits"] = before["outer_bits"] = mb + 1
            before["version"] = version
        if version == 3:
            before["static_grids"] = True
        assert json.dumps(d) == json.dumps(before)  # key order and values, byte for byte
    on = OakenConfig(middle_bits=mb, static_grids=True, static_levels=DEFAULT_STATIC_LEVELS)
    d = on.to_dict()
    assert d["version"] == 4 and list(d) == [*V1_DEFAULT, "static_grids", "static_levels"]
    assert d["static_levels"] == [0.5, 0.7, 0.85, 1.0]
    assert OakenConfig.from_dict(json.loads(json.dumps(d))) == on
    assert OakenConfig(static_grids=True, static_levels=[0.5, 1]).static_levels == (0.5, 1.0)  # floats, a tuple
    assert on != on.replace(static_levels=()) and hash(on) != hash(on.replace(static_levels=()))


def test_static_levels_are_validated_and_versioned():
    ok = {"static_grids": True}
    for bad, match in (
        ((0.5, 1.0), "needs static_grids=True"),
        ((1.0,), "2 to 16"),
        (tuple(i / 17 for i in range(1, 18)), "2 to 16"),
        ((0.0, 1.0), r"numbers in \(0, 1\]"),
        ((0.5, 1.5), r"numbers in \(0, 1\]"),
        ((True, 1.0), r"numbers in \(0, 1\]"),
        ((float("nan"), 1.0), r"numbers in \(0, 1\]"),
        (("0.5", 1.0), r"numbers in \(0, 1\]"),
        ((0.7, 0.5, 1.0), "ascend strictly"),
        ((0.5, 0.5, 1.0), "ascend strictly"),
        ((0.5, 1.0 - 1e-12, 1.0), "ascend strictly"),  # distinct in float64, not in float32
        ((0.5, 0.9), "end with exactly 1.0"),
        (0.5, "tuple of clip factors"),
    ):
        kw = ok if match != "needs static_grids=True" else {}
        with pytest.raises(ValueError, match=match):
            OakenConfig(**kw, static_levels=bad)
    d = OakenConfig(static_grids=True, static_levels=(0.5, 1.0)).to_dict()
    with pytest.raises(ValueError, match="must give static_levels"):
        OakenConfig.from_dict({k: v for k, v in d.items() if k != "static_levels"})
    with pytest.raises(ValueError, match="must give static_grids"):
        OakenConfig.from_dict({k: v for k, v in d.items() if k != "static_grids"})
    with pytest.raises(ValueError, match="list of numbers"):
        OakenConfig.from_dict({**d, "static_levels": "0.5,1"})
    with pytest.raises(ValueError, match="needs static_grids=True"):
        OakenConfig.from_dict({**d, "static_grids": False})
    for version in (1, 2, 3):
        with pytest.raises(ValueError, match="static_levels needs a version-4"):
            OakenConfig.from_dict({**d, "version": version})
