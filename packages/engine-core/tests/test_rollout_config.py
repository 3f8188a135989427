"""The rollout config and the per-call sampling config: one declaration of the sampling knobs."""

from __future__ import annotations

import pytest


def test_sampling_config_is_built_from_the_rollout_config():
    """SamplingConfig and RolloutConfig share one declaration of the sampling knobs (and their checks)."""
    from dataclasses import fields

    from posttrain.core.rollout import RolloutConfig, SamplingConfig, SamplingKnobs

    rollout = RolloutConfig(temperature=0.7, top_p=0.9, top_k=5, n=4, response_length=33, val_n=2)
    train = rollout.sampling()
    for f in fields(SamplingKnobs):
        assert getattr(train, f.name) == getattr(rollout, f.name), f.name
    assert train.max_new_tokens == 33
    val = rollout.sampling(validate=True)
    assert (val.temperature, val.n, val.top_p, val.top_k, val.max_new_tokens) == (0.0, 2, 1.0, -1, 33)
    for bad, key in (
        ({"top_p": 0.0}, "rollout.top_p"),
        ({"top_k": 0}, "rollout.top_k"),
        ({"n": 0}, "rollout.n"),
    ):
        with pytest.raises(ValueError, match=key):
            RolloutConfig(**bad)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingConfig(temperature=-1)


def test_a_plain_rollout_config_becomes_a_rollouts_own():
    """``cls.of``: a plain RolloutConfig keeps every shared field and takes the rollout's defaults (its name
    too); the rollout's own config is kept; another rollout's config is refused (its knobs would be lost)."""
    from dataclasses import dataclass, fields

    from posttrain.core.rollout import RolloutConfig

    @dataclass(kw_only=True)
    class MineConfig(RolloutConfig):
        name: str = "mine"
        knob: int = 5

    @dataclass(kw_only=True)
    class TheirsConfig(RolloutConfig):
        name: str = "theirs"

    plain = RolloutConfig(n=3, temperature=0.5, prompt_length=7, load_format="dummy")
    mine = MineConfig.of(plain)
    assert type(mine) is MineConfig and (mine.name, mine.knob) == ("mine", 5)
    assert all(
        getattr(mine, f.name) == getattr(plain, f.name) for f in fields(RolloutConfig) if f.name != "name"
    )
    assert MineConfig.of(mine) is mine
    with pytest.raises(ValueError, match="a TheirsConfig .* cannot configure a MineConfig"):
        MineConfig.of(TheirsConfig())


def test_serves_requests_reads_the_rollouts_own_answer_before_agenerate():
    from posttrain.core.rollout import serves_requests

    class Batches:
        pass

    class Requests:
        async def agenerate(self, prompt_ids, sampling, prompt_index=0):
            return []

    class SomeSettings(Requests):
        def __init__(self, on: bool) -> None:
            self.serves_requests = on

    assert not serves_requests(Batches()) and serves_requests(Requests())
    assert serves_requests(SomeSettings(True)) and not serves_requests(SomeSettings(False))
