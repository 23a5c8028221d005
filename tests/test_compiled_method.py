"""Methods run as one graph compiled by TorchInductor (runtime/compiled_method.py): the same
tokens and logits as the executor's kernel-per-instruction run of the same program, for
transformers decoders (static views, a tied head, MoE experts, int8 weights), and the refusals."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from hostswap import llm
from hostswap.runtime import Module
from hostswap.runtime.compiled_method import CompiledExecutor, functional_overload
from hostswap.schedules.serialization import load_weight_schedules
from hostswap.schedules.weight_schedule import load_floor_bytes

from real_models import BY_NAME, VOCAB, build

MB = 2**20
MAX_SEQ_LEN, CHUNK, NEW = 32, 4, 12
CASES = [("Llama", None), ("Qwen2", None), ("Qwen3", None), ("Phi-3", None), ("Gemma", None), ("Mixtral", None), ("GPT-2", None), ("Gemma3", None),
         ("Llama", "int8")]


def _prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))


def _every_weight_mb(pte) -> float:
    return max(s.all_resident_budget_bytes for s in load_weight_schedules(pte).values()) / MB


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    made = {}

    def get(name: str, scheme: str | None):
        if (name, scheme) not in made:
            model = build(BY_NAME[name])[0]
            if scheme is not None:
                model = llm.quantize(copy.deepcopy(model), scheme)
            made[name, scheme] = llm.export(model, os.path.join(tmp_path_factory.mktemp(name), "m"), max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
        return made[name, scheme]

    return get


@pytest.mark.parametrize("name,scheme", CASES, ids=[f"{n}-{s or 'plain'}" for n, s in CASES])
def test_compiled_decode_gives_the_executors_tokens_and_logits(programs, name, scheme):
    paths = programs(name, scheme)
    budget = _every_weight_mb(paths[0])
    step = [torch.tensor([[5]]), torch.tensor([MAX_SEQ_LEN // 2])]
    with llm.Generator(*paths, weight_offload_budget_mb=budget, device="cpu") as g:
        expected = g.generate(_prompt(), NEW, eos_token_id=[])
        expected_logits = g.module.run_method(llm.DECODE, step)[0]
    with llm.Generator(*paths, weight_offload_budget_mb=budget, device="cpu", compiled=(llm.DECODE,)) as g:
        assert isinstance(g.module._probed[llm.DECODE].executor, CompiledExecutor)
        got = g.generate(_prompt(), NEW, eos_token_id=[])
        logits = g.module.run_method(llm.DECODE, step)[0]
        again = g.generate(_prompt(), NEW, eos_token_id=[])  # the cache written in place by the compiled graph, reset between calls
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())
    assert torch.equal(again, expected)
    # inductor sums in its own order: fp32 logits within rounding of the executor's
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)


def test_compiled_prefill_and_decode(programs):
    paths = programs("Llama", None)
    budget = _every_weight_mb(paths[0])
    with llm.Generator(*paths, weight_offload_budget_mb=budget, device="cpu") as g:
        expected = g.generate(_prompt(), NEW, eos_token_id=[])
    with llm.Generator(*paths, weight_offload_budget_mb=budget, device="cpu", compiled=True) as g:
        assert torch.equal(g.generate(_prompt(), NEW, eos_token_id=[]), expected)


def test_compiled_draft_keeps_the_targets_greedy_output(tmp_path):
    target = llm.export(build(BY_NAME["Qwen2"])[0], os.path.join(tmp_path, "target"), max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, speculate_k=4)
    draft = os.path.join(tmp_path, "draft")
    llm.export(llm.quantize(build(BY_NAME["Qwen2"])[0], "int8"), draft, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    floor = load_floor_bytes(load_weight_schedules(target[0])) / MB + 0.01
    with llm.Generator(*target, weight_offload_budget_mb=floor, device="cpu") as g:
        expected = g.generate(_prompt(), NEW, eos_token_id=[])
    with llm.Generator(*target, weight_offload_budget_mb=floor, device="cpu", draft=draft, speculate_k=4, compile_draft=True) as g:
        assert isinstance(g.draft.module._probed[llm.DECODE].executor, CompiledExecutor)
        out = g.generate(_prompt(), NEW, eos_token_id=[])
        assert g.last_speculation.accepted > 0  # the int8 copy agrees somewhere: the compiled draft proposes real tokens
    assert torch.equal(out, expected), (out.tolist(), expected.tolist())


def test_compiled_refuses_a_budget_that_streams(programs):
    paths = programs("Llama", None)
    floor = load_floor_bytes(load_weight_schedules(paths[0])) / MB + 0.01
    with pytest.raises(ValueError, match=r"compiled needs every weight but routed experts resident.*needs [0-9.]+ MiB to hold them"):
        Module(*paths, weight_offload_budget_mb=floor, device="cpu", compiled=True)


@pytest.mark.parametrize("options,message", [
    ({"compiled": ("nope",)}, r"compiled names \['nope'\]"),
    ({"compiled": "decode"}, r"compiled must be True, False or a tuple of method names"),
    ({"compiled": True, "policy": "lru"}, r"compiled needs policy='planned'"),
])
def test_compiled_argument_errors(programs, options, message):
    paths = programs("Llama", None)
    with pytest.raises(ValueError, match=message):
        Module(*paths, weight_offload_budget_mb=_every_weight_mb(paths[0]), device="cpu", **options)


def test_compile_draft_argument_errors(programs):
    paths = programs("Llama", None)
    with pytest.raises(llm.GenerationError, match="compile_draft must be True, False or None"):
        llm.Generator(*paths, weight_offload_budget_mb=_every_weight_mb(paths[0]), device="cpu", draft=paths[0], compile_draft="yes")
    with llm.Generator(*paths, weight_offload_budget_mb=_every_weight_mb(paths[0]), device="cpu") as loaded:
        with pytest.raises(llm.GenerationError, match="compile_draft applies to a draft given by its path"):
            llm.Generator(*paths, weight_offload_budget_mb=_every_weight_mb(paths[0]), device="cpu", draft=loaded, compile_draft=True)


@pytest.mark.parametrize("op,functional", [
    (torch.ops.aten.add.out, torch.ops.aten.add.Tensor),
    (torch.ops.aten.mean.out, torch.ops.aten.mean.dim),
    (torch.ops.aten.arange.start_out, torch.ops.aten.arange.start_step),
    (torch.ops.aten.pow.Tensor_Scalar_out, torch.ops.aten.pow.Tensor_Scalar),
    (torch.ops.aten.le.Tensor_out, torch.ops.aten.le.Tensor),
    (torch.ops.aten.slice_copy.Tensor_out, torch.ops.aten.slice_copy.Tensor),
    (torch.ops.aten.max.dim_max, torch.ops.aten.max.dim),
    (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default),
    (torch.ops.aten.copy_.default, torch.ops.aten.copy.default),
])
def test_functional_overload_of_out_and_in_place_ops(op, functional):
    assert functional_overload(op._schema) is functional


def _bytes_of(regions: dict, tensors: dict):
    """A stand-in for a loaded method: value id -> (memory id, start, end) and its planned tensor."""
    from types import SimpleNamespace

    return SimpleNamespace(name="m", regions=regions, values=tensors, contiguous={v: t.is_contiguous() for v, t in tensors.items()})


def test_values_are_followed_by_their_bytes():
    """A static view (ExecuTorch plans it in its base's bytes, with no instruction) reads what
    was last written there: the whole write reshaped, or the slice of it its bytes cover."""
    import torch.fx

    from hostswap.runtime.compiled_method import _Memory

    method = _bytes_of({0: (1, 0, 64), 1: (1, 0, 64), 2: (1, 16, 32)},
                       {0: torch.empty(4, 4), 1: torch.empty(16), 2: torch.empty(4)})
    graph = torch.fx.Graph()
    memory = _Memory(graph, method)
    x = graph.placeholder("x")
    memory.write(0, x)
    whole, part = memory.read(1), memory.read(2)
    graph.output((whole, part))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    value = torch.arange(16.0).reshape(4, 4)
    got_whole, got_part = gm(value)
    assert torch.equal(got_whole, value.reshape(16)) and torch.equal(got_part, value.reshape(16)[4:8])


@pytest.mark.parametrize("regions,tensors,message", [
    ({0: (1, 0, 16), 1: (1, 0, 32)}, {0: torch.empty(4), 1: torch.empty(8)}, "which no one write covers"),
    ({0: (1, 0, 16), 1: (1, 0, 16)}, {0: torch.empty(4), 1: torch.empty(4, dtype=torch.int32)}, "as another dtype or layout"),
])
def test_bytes_read_otherwise_than_written_refuse_to_compile(regions, tensors, message):
    import torch.fx

    from hostswap.runtime.compiled_method import _Memory
    from hostswap.runtime.instructions import ProgramError

    graph = torch.fx.Graph()
    memory = _Memory(graph, _bytes_of(regions, tensors))
    memory.write(0, graph.placeholder("x"))
    with pytest.raises(ProgramError, match=message):
        memory.read(1)


def _cannot_build():
    from hostswap.runtime.instructions import ProgramError

    raise ProgramError("method 'decode' has jumps; only straight-line methods compile")


def test_a_method_that_cannot_be_compiled_runs_op_by_op_where_possible():
    """``compiled_where_possible`` (a draft given by path, by default): a graph that cannot be
    built loads the executor instead, with a warning that names the method and why; asked for
    outright, the error stands."""
    from hostswap.runtime.compiled_method import compiled_or_none
    from hostswap.runtime.instructions import ProgramError

    with pytest.warns(UserWarning, match=r"d.pte: method 'decode' runs a kernel per instruction: method 'decode' has jumps"):
        assert compiled_or_none(_cannot_build, True, "d.pte: method 'decode'") is None
    with pytest.raises(ProgramError, match="has jumps"):
        compiled_or_none(_cannot_build, False, "d.pte: method 'decode'")


def _overlapping_state():
    """A method over a 64-byte state arena: value 0 is all of it, value 1 its first half. It
    fills the half with 5, writes the whole with ones, then fills the half with 7."""
    from types import SimpleNamespace

    from hostswap.runtime.instructions import Kernel

    arena = torch.zeros(64, dtype=torch.uint8)
    values = [arena.view(torch.float32), arena[:32].view(torch.float32), 5.0, None, torch.ones(16), None, 7.0]
    method = SimpleNamespace(name="m", plan=SimpleNamespace(inputs=[], outputs=[], name="m"), device=torch.device("cpu"), values=values,
                             regions={0: (0, 0, 64), 1: (0, 0, 32)}, contiguous={0: True, 1: True}, state_ids=frozenset({0}), unplanned=set())
    method.instructions = [Kernel("kernel", torch.ops.aten.fill_.Scalar, [1, 2], {}, [1], None, 0, {}, {}),
                           Kernel("kernel", torch.ops.aten.clone.out, [4], {"memory_format": 5, "out": 0}, [0], None, 1, {}, {}),
                           Kernel("kernel", torch.ops.aten.fill_.Scalar, [1, 6], {}, [1], None, 2, {}, {})]
    return arena, method


def test_state_written_over_itself_goes_back_in_the_order_written():
    from hostswap.runtime.compiled_method import method_graph
    from hostswap.runtime.executor import MethodExecutor

    arena, method = _overlapping_state()
    MethodExecutor(method)._interpret(None, None)
    expected = arena.view(torch.float32).clone()
    assert expected.tolist() == [7.0] * 8 + [1.0] * 8
    arena, method = _overlapping_state()
    graph = method_graph(method, method.instructions, None)
    graph.check()
    graph.module(*graph.inputs)
    assert torch.equal(arena.view(torch.float32), expected)


@pytest.mark.parametrize("case", ["decode", "causal", "causal and mask", "float mask", "a row masked everywhere"])
def test_attention_math_is_sdpa(case):
    """The compiled graph's attention against PyTorch's: grouped heads, SDPA's upper-left causal
    mask, a mask with it, an additive mask, and a row that sees nothing (zeros, not NaN)."""
    import torch.nn.functional as F

    from hostswap.runtime.compiled_method import attention_math

    g = torch.Generator().manual_seed(0)
    s = 1 if case == "decode" else 3
    q, k, v = torch.randn(1, 6, s, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    mask, causal = None, case.startswith("causal")
    if case in ("decode", "causal and mask", "a row masked everywhere"):
        mask = torch.rand(1, 1, s, 5, generator=g) > 0.3
        mask[..., 0] = True
        if case == "a row masked everywhere":
            mask[0, 0, 1] = False
    if case == "float mask":
        mask = torch.randn(1, 1, s, 5, generator=g)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    got = attention_math(q, k, v, mask, 0.0, causal, None, True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_views_copy_runs_as_the_view_and_a_clone():
    """slice_copy and select_copy (rotary's halves, a row) become the view and a contiguous
    clone, the same values in a fresh tensor, which inductor fuses into their readers; a
    split's copies (a list) and ops that are not a view's copy stay as they are."""
    from hostswap.runtime.compiled_method import view_copy_form

    x = torch.arange(24.0).reshape(2, 3, 4)
    for op, args in ((torch.ops.aten.slice_copy.Tensor, (x, 2, 2, 4)), (torch.ops.aten.select_copy.int, (x, 1, 1)),
                     (torch.ops.aten.permute_copy.default, (x, [2, 0, 1]))):
        got = view_copy_form(op)(*args)
        assert torch.equal(got, op(*args)) and got.is_contiguous() and got.data_ptr() != x.data_ptr()
    assert view_copy_form(torch.ops.aten.split_with_sizes_copy.default) is None
    assert view_copy_form(torch.ops.aten._to_copy.default) is None and view_copy_form(torch.ops.aten.add.Tensor) is None
