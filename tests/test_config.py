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
    assert d["version"] == (1 if mb == 4 else CONFIG_VERSION) and d["middle_bits"] == mb
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
    # replace keeps the explicit bits: a 4-bit config's 5-bit outliers do not fit a 3-bit slot
    with pytest.raises(ValueError, match="inner_bits"):
        OakenConfig().replace(middle_bits=3)
    assert OakenConfig().replace(middle_bits=3, inner_bits=4, outer_bits=4) == OakenConfig(middle_bits=3)


def test_versions_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="middle_bits must be 4 in a version-1 config"):
        OakenConfig.from_dict({**V1_DEFAULT, "middle_bits": 3, "inner_bits": 4, "outer_bits": 4})
    v2 = OakenConfig(middle_bits=3).to_dict()
    with pytest.raises(ValueError, match="must give middle_bits"):
        OakenConfig.from_dict({k: v for k, v in v2.items() if k != "middle_bits"})
    with pytest.raises(ValueError, match="chunk_size must be 64"):
        OakenConfig.from_dict({**v2, "chunk_size": 32})
    for version in (0, 3, True, "2"):
        with pytest.raises(ValueError, match="unsupported OakenConfig version"):
            OakenConfig.from_dict({**v2, "version": version})
