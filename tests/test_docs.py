"""docs/api.md against the code: every public op has a docstring and a section ``## `name` `` whose first ``python``
block is the op's ``def`` as in the code (parameter names, order, kinds, defaults, annotations, return annotation),
whose argument table lists the same parameters in order, and whose further ``python`` blocks (the examples) run.
Also the non-finite containment the reference states for the PyTorch path."""

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tilela

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"
OPS = list(tilela.__all__)
EMPTY = inspect.Parameter.empty


def _sections() -> dict[str, str]:
    """The text under each ``## `name` `` heading of docs/api.md, by name."""
    parts = re.split(r"^## ", API.read_text(), flags=re.M)[1:]
    return {m.group(1): part for part in parts if (m := re.match(r"`(\w+)`\n", part))}


def _python_blocks(section: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S)


def _norm(annotation: str | None) -> str | None:
    """An annotation's source in one spelling (spacing, quotes)."""
    return None if annotation is None else ast.unparse(ast.parse(annotation, mode="eval"))


def _documented(block: str, name: str) -> tuple[list[tuple], str | None]:
    """(parameters as (name, kind, default, annotation), return annotation) of the doc block's ``def name``."""
    tree = ast.parse(block)
    assert len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef), "the block must be one def"
    fn = tree.body[0]
    assert fn.name == name, f"the block defines {fn.name}, not {name}"
    a = fn.args
    positional = [(p, inspect.Parameter.POSITIONAL_ONLY) for p in a.posonlyargs]
    positional += [(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in a.args]
    defaults = [EMPTY] * (len(positional) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    params = [(p.arg, kind, d, _norm(p.annotation and ast.unparse(p.annotation)))
              for (p, kind), d in zip(positional, defaults)]
    if a.vararg:
        params.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, EMPTY, None))
    params += [(p.arg, inspect.Parameter.KEYWORD_ONLY, EMPTY if d is None else ast.literal_eval(d),
                _norm(p.annotation and ast.unparse(p.annotation))) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, EMPTY, None))
    return params, _norm(fn.returns and ast.unparse(fn.returns))


def _annotation(x) -> str | None:
    if x is EMPTY:
        return None
    return _norm(x if isinstance(x, str) else inspect.formatannotation(x))


def _in_code(op) -> tuple[list[tuple], str | None]:
    sig = inspect.signature(op)
    params = [(p.name, p.kind, p.default, _annotation(p.annotation)) for p in sig.parameters.values()]
    return params, _annotation(sig.return_annotation)


def _render(name: str, op) -> str:
    """The doc block for op as the code defines it (printed on a mismatch, to paste into docs/api.md)."""
    sig = inspect.signature(op)
    lines, star = [f"def {name}("], False
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            lines.append("    *,")
            star = True
        stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        text = stars + (p.name if p.annotation is EMPTY else f"{p.name}: {_annotation(p.annotation)}")
        if p.default is not EMPTY:
            text += f" = {p.default!r}".replace("'", '"')
        lines.append(f"    {text},")
    returns = "" if sig.return_annotation is EMPTY else f" -> {_annotation(sig.return_annotation)}"
    return "\n".join(lines + [f"){returns}: ..."])


def test_every_public_op_has_a_docstring_and_one_section():
    sections = _sections()
    for name in OPS:
        assert inspect.getdoc(getattr(tilela, name)), f"tilela.{name} has no docstring"
    assert sorted(sections) == sorted(OPS), "docs/api.md's ``## `op` `` sections must be tilela.__all__"


@pytest.mark.parametrize("name", OPS)
def test_signature_block_matches_the_code(name):
    op = getattr(tilela, name)
    blocks = _python_blocks(_sections()[name])
    assert blocks, f"docs/api.md, {name}: no python block"
    expected = _render(name, op)
    assert _documented(blocks[0], name) == _in_code(op), (
        f"docs/api.md, {name}: the signature block differs from the code; the code's is\n\n{expected}\n")


@pytest.mark.parametrize("name", OPS)
def test_argument_table_lists_the_parameters(name):
    rows = re.findall(r"^\| `(\w+)` \|", _sections()[name].split("| argument |", 1)[-1], flags=re.M)
    assert rows == list(inspect.signature(getattr(tilela, name)).parameters), (
        f"docs/api.md, {name}: the argument table must list the op's parameters in order")


@pytest.mark.parametrize("name", OPS)
def test_examples_run(name):
    examples = _python_blocks(_sections()[name])[1:]
    assert examples, f"docs/api.md, {name}: no example"
    torch.manual_seed(0)
    for example in examples:
        exec(compile(example, f"docs/api.md:{name}", "exec"), {})


def test_the_signature_check_sees_a_changed_parameter():
    block = _python_blocks(_sections()["chunk_local_cumsum"])[0]
    code = _in_code(tilela.chunk_local_cumsum)
    assert _documented(block, "chunk_local_cumsum") == code
    for edited in (block.replace("chunk_size: int = 64", "chunk_size: int = 32"),
                   block.replace("    *,\n", ""),
                   block.replace("scale", "factor"),
                   block.replace("cu_seqlens: torch.Tensor | None = None,\n", "")):
        assert _documented(edited, "chunk_local_cumsum") != code


ATTENTION = {  # op: (gate shape after [B, T, HV] or None, takes beta)
    "chunk_gated_delta_rule": ((), True), "chunk_kda": ((32,), True), "chunk_delta_rule": (None, True),
    "chunk_linear_attn": (None, False), "chunk_simple_gla": ((), False), "chunk_gla": ((32,), False),
}
POISONED = [(name, x) for name, (gate, takes_beta) in ATTENTION.items()
            for x in ("q", "k", "v") + ("g",) * (gate is not None) + ("beta",) * takes_beta]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("name,poisoned", POISONED)
def test_non_finite_stays_in_its_sequence_heads_and_chunk(name, poisoned, value):
    """api.md, "NaN and Inf", PyTorch path: a NaN or Inf at token 140 (sequence 1, tokens 70-199, its chunk from
    134) in q/k head 0 (value heads 0-1) or value head 1 reaches neither sequences 0 and 2, nor other heads, nor
    tokens before 134; one in q only its own token."""
    gate, takes_beta = ATTENTION[name]
    gen = torch.Generator().manual_seed(0)
    T, H, HV, K = 260, 2, 4, 32
    cu = torch.tensor([0, 70, 200, 260])
    x = dict(q=torch.randn(1, T, H, K, generator=gen), k=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
             v=torch.randn(1, T, HV, K, generator=gen))
    if gate is not None:
        x["g"] = F.logsigmoid(torch.randn(1, T, HV, *gate, generator=gen))
    if takes_beta:
        x["beta"] = torch.rand(1, T, HV, generator=gen)
    head = 0 if poisoned in ("q", "k") else 1
    x[poisoned][0, 140, head] = value
    plain = {"normalize": False} if name == "chunk_linear_attn" else {}
    o, S = getattr(tilela, name)(**x, output_final_state=True, cu_seqlens=cu, **plain)
    reached = ~torch.isfinite(o[0]).all(-1)  # [T, HV]
    heads = [0, 1] if poisoned in ("q", "k") else [1]
    assert reached[:, heads].any()
    first = 140 if poisoned == "q" else 134
    last = 141 if poisoned == "q" else 200
    outside = reached.clone()
    outside[first:last, heads] = False
    assert not outside.any()
    assert torch.isfinite(S[[0, 2]]).all() and torch.isfinite(S[1, [h for h in range(HV) if h not in heads]]).all()
