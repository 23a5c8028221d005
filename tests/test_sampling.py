"""Sampling on the device (hostswap.sampling): parameters checked and named, the distribution
each knob leaves, the same seed giving the same tokens, and greedy unchanged."""

from __future__ import annotations

import os

import pytest
import torch

import hostswap.llm as llm
from hostswap.sampling import NO_TOKEN, SamplingError, SamplingParams, TokenChooser, draw

from real_models import BY_NAME, VOCAB, build

LOGITS = torch.tensor([2.0, 1.5, 0.5, -1.0, -3.0])


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                                          ("top_k", 1.5), ("top_k", True), ("repetition_penalty", 0.0), ("seed", "x"), ("seed", 2**64),
                                          ("seed", -(2**63) - 1), ("temperature", "hot")])
def test_bad_parameters_are_named(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})


def _draws(params: SamplingParams, n: int = 4000, prompt=torch.tensor([[4]])) -> torch.Tensor:
    chooser = TokenChooser(params, torch.device("cpu"), LOGITS.numel(), prompt)
    return torch.tensor([int(chooser(LOGITS)[0]) for _ in range(n)])


def test_temperature_one_draws_the_softmax():
    counts = torch.bincount(_draws(SamplingParams(temperature=1.0, seed=0)), minlength=5).float() / 4000
    assert (counts - torch.softmax(LOGITS, -1)).abs().max() < 0.03


def test_top_k_top_p_and_temperature_cut_the_tail():
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=1)).tolist()) == {0, 1}
    # probabilities 0.53, 0.32, 0.12, ...: the smallest prefix reaching 0.5 is the first token alone
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.5, seed=2)).tolist()) == {0}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.8, seed=2)).tolist()) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1e-4, seed=3), n=200).tolist()) == {0}


def test_repetition_penalty_lowers_tokens_already_seen():
    chooser = TokenChooser(SamplingParams(repetition_penalty=10.0), torch.device("cpu"), 5, torch.tensor([[0]]))
    token, logprob = chooser(LOGITS)  # token 0 was in the prompt: 2.0 / 10 falls below 1.5
    assert int(token) == 1 and float(logprob) < 0
    token, _ = chooser(LOGITS)  # now 1 is seen too: 1.5 / 10 < 0.5
    assert int(token) == 2


def test_the_same_seed_draws_the_same_tokens():
    a, b = _draws(SamplingParams(temperature=1.0, seed=7), n=50), _draws(SamplingParams(temperature=1.0, seed=7), n=50)
    assert torch.equal(a, b) and not torch.equal(a, _draws(SamplingParams(temperature=1.0, seed=8), n=50))


def test_a_draw_is_torch_multinomials_draw_for_the_same_generator_state():
    """``draw`` (its check a device op, not an assertion) takes the index torch.multinomial takes and leaves the
    generator where it leaves it: sampled tokens did not change when it replaced it."""
    for seed in range(100):
        p = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(seed)) * 3, -1)
        mine, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(3):
            assert int(draw(p, mine)) == int(torch.multinomial(p, 1, generator=theirs))


def test_logits_with_a_nan_stop_decoding_with_an_error_and_reach_no_step():
    nan = float("nan")
    chooser = TokenChooser(SamplingParams(temperature=1.0, seed=0), torch.device("cpu"), 5, torch.tensor([[0]]))
    assert int(chooser(torch.tensor([1.0, nan, 0.0, 0.0, 0.0]))[0]) == NO_TOKEN
    fed = []

    def step(method, token, positions):  # the third step's logits hold a NaN
        fed.append(int(token))
        logits = torch.zeros(1, 1, 5)
        logits[..., 2] = nan if len(fed) == 3 else 0.0
        return logits

    kept = []
    with pytest.raises(SamplingError, match="hold a NaN"):
        llm.decode_tokens(step, torch.zeros(1, 1, 5), 0, 8, on_token=kept.append,
                          choose=TokenChooser(SamplingParams(temperature=1.0, seed=0), torch.device("cpu"), 5, torch.tensor([[0]])))
    assert len(kept) == 3 and all(0 <= t < 5 for t in kept + fed)  # the tokens before it, and no NO_TOKEN fed to a step


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampling")
    return llm.export(build(BY_NAME["Llama"])[0].eval(), os.path.join(folder, "model"), max_seq_len=30, prefill_chunk=4)


def test_generator_samples_reproducibly_and_greedy_is_unchanged(program):
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    with llm.Generator(*program, weight_offload_budget_mb="auto", device="cpu") as g:
        greedy = g.generate(prompt, 12, eos_token_id=[])
        assert g.last_logprobs is None
        again = g.generate(prompt, 12, eos_token_id=[], sampling=SamplingParams(), logprobs=True)
        assert torch.equal(greedy, again) and len(g.last_logprobs) == 12 and all(p <= 0 for p in g.last_logprobs)
        assert torch.equal(g.generate(prompt, 12, eos_token_id=[], sampling=SamplingParams(temperature=1.0, top_k=1, seed=4)), greedy)
        hot = SamplingParams(temperature=1.5, top_p=0.95, seed=11)
        first, second = g.generate(prompt, 12, eos_token_id=[], sampling=hot), g.generate(prompt, 12, eos_token_id=[], sampling=hot)
        assert torch.equal(first, second) and not torch.equal(first, greedy)
        with pytest.raises(llm.GenerationError, match="sampling must be a hostswap.sampling.SamplingParams"):
            g.generate(prompt, 2, sampling={"temperature": 1.0})


def test_generate_cli_samples_with_a_seed_and_names_a_bad_parameter(program):
    import subprocess
    import sys

    prefix = os.path.splitext(program[0])[0]
    run = lambda *a: subprocess.run([sys.executable, "-m", "hostswap.cli", "generate", prefix, "--prompt-ids", "1,2,3", "--max-new-tokens", "6",  # noqa: E731
                                     "--device", "cpu", *a], capture_output=True, text=True, timeout=600)
    first, second = run("--temperature", "1.2", "--top-p", "0.9", "--seed", "3"), run("--temperature", "1.2", "--top-p", "0.9", "--seed", "3")
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout == second.stdout and first.stdout.strip()
    bad = run("--top-p", "0")
    assert bad.returncode == 2 and "top_p must be a number above 0.0" in bad.stderr


def test_the_sampling_warm_up_chooses_without_touching_the_global_generator_or_raising_on_a_nan():
    from hostswap.sampling import warm_up_sampling

    logits = torch.randn(1, 1, 50)
    state = torch.random.get_rng_state()
    warm_up_sampling(logits)
    warm_up_sampling(torch.full((50,), float("nan")))  # a warm-up's logits are not a request's: no error
    assert torch.equal(torch.random.get_rng_state(), state)
