"""The RL loop's alignment monitor: warn above alignment.warn_above, stop above alignment.stop_above."""
import logging

import pytest

from minite.alignment.monitor import AlignmentError, check_gap
from minite.config import AlignmentConfig, ConfigError, load_config


def _m(gap):
    return {"mismatch/logp_abs_max": gap, "mismatch/logp_abs_mean": gap / 2}


def test_warns_above_warn_threshold_only(caplog):
    a = AlignmentConfig(warn_above=1e-6)
    with caplog.at_level(logging.WARNING):
        check_gap(_m(1e-7), a, 3)
        assert not caplog.records
        check_gap(_m(1e-5), a, 4)
    assert "step 4" in caplog.text and "minite diagnose" in caplog.text


def test_stops_above_stop_threshold():
    a = AlignmentConfig(warn_above=0.0, stop_above=1e-3)
    check_gap(_m(1e-3), a, 0)  # equal is not above
    with pytest.raises(AlignmentError, match="stop_above"):
        check_gap(_m(2e-3), a, 7)


def test_no_thresholds_no_action():
    check_gap(_m(10.0), AlignmentConfig(), 0)
    check_gap(_m(10.0), None, 0)


def test_alignment_config_validation():
    with pytest.raises(ConfigError, match="stop_above"):
        load_config(None, ["alignment.warn_above=1e-3", "alignment.stop_above=1e-6"])
    with pytest.raises(ConfigError, match="exclusive"):
        load_config(None, ["alignment.strict=true", "alignment.routing_replay=true"])
    assert load_config(None, ["alignment.strict=true"]).alignment.strict
