"""EarlyStop: patience counted in evaluations, an improvement is a drop of more than min_delta, the state
round-trips through a checkpoint's JSON."""

import json

import pytest

from ftlib.train import EarlyStop


def test_stops_after_patience_evals_without_an_improvement_of_more_than_min_delta():
    es = EarlyStop(patience=2, min_delta=0.1)
    assert [es.update(x) for x in (3.0, 2.0, 1.95, 1.5, 1.45, 1.41)] == [False, False, False, False, False, True]
    assert es.best == 1.5 and es.bad == 2 and es.stopped
    assert es.update(0.1) and es.stopped  # a stop is final


def test_no_patience_never_stops():
    es = EarlyStop()
    assert not any(es.update(x) for x in (1.0, 2.0, 3.0, 4.0)) and es.best is None


def test_state_round_trips_through_json_and_unknown_keys_are_refused():
    es = EarlyStop(patience=3)
    for x in (2.0, 2.5, 2.6):
        es.update(x)
    again = EarlyStop(patience=3)
    again.load_state_dict(json.loads(json.dumps(es.state_dict())))
    assert again.state_dict() == {"best": 2.0, "bad": 2, "stopped": False}
    assert again.update(2.1)  # the resumed run keeps counting: the third bad eval stops it
    with pytest.raises(ValueError, match="unknown keys \\['patience'\\]"):
        again.load_state_dict({"patience": 5})
    with pytest.raises(ValueError, match="patience must be >= 0"):
        EarlyStop(patience=-1)
