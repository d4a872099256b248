"""The parity helper's state comparison: exact where gradients exist, bounded where none do."""

from __future__ import annotations

import pytest
import torch

from fusion.models.gpt2 import GPT2, GPT2Config
from tests.support.parity import NOISE_BOUND, assert_state_close


def _state() -> dict[str, torch.Tensor]:
    bias = torch.linspace(-0.01, 0.01, 96)
    bias[32:64] = 3e-6  # the key bias: rounding noise only
    return {"transformer.h.0.attn.c_attn.bias": bias, "lm_head.weight": torch.ones(4, 4)}


def test_key_bias_noise_is_not_compared_entry_by_entry() -> None:
    got = _state()
    got["transformer.h.0.attn.c_attn.bias"][40] = -6e-6  # different noise, as two correct runs have
    assert_state_close(got, _state())


def test_a_wrong_query_or_value_bias_still_fails() -> None:
    for idx in (3, 70):
        got = _state()
        got["transformer.h.0.attn.c_attn.bias"][idx] += 1e-3
        with pytest.raises(AssertionError, match="c_attn.bias"):
            assert_state_close(got, _state())


def test_a_key_bias_beyond_noise_fails() -> None:
    got = _state()
    got["transformer.h.0.attn.c_attn.bias"][50] = 10 * NOISE_BOUND
    with pytest.raises(AssertionError, match="beyond rounding noise"):
        assert_state_close(got, _state())


def test_other_entries_and_missing_names_fail() -> None:
    got = _state()
    got["lm_head.weight"][0, 0] += 1e-3
    with pytest.raises(AssertionError, match="lm_head.weight"):
        assert_state_close(got, _state())
    with pytest.raises(AssertionError):
        assert_state_close({"lm_head.weight": torch.ones(4, 4)}, _state())


def test_the_key_bias_gradient_is_zero_up_to_rounding() -> None:
    """Why the helper may treat it as noise: the softmax ignores the shift it adds."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    x = torch.randint(0, 64, (2, 16))
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    grad = model.transformer.h[0].attn.c_attn.bias.grad
    assert grad[16:32].abs().max() < 1e-7  # key: rounding noise
    assert grad[32:].abs().max() > 1e-4  # value: a real gradient
