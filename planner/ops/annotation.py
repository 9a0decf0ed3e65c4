"""Declarative labellings: an op's DimLabels from a one-line annotation.

In the spirit of nnScaler's op annotations, a regular op states its labelling as text,
parsed once (when the registry is built) into a labelling function:

    "*, ... -> *"                     every elementwise op (numpy broadcasting)
    "*, ?, ? -> *"                    Clip: the bounds are not data
    "* m k+, * k+ n -> * m n"         MatMul of two matrices (batch dims broadcast)

Grammar::

    annotation := terms "->" terms          inputs left of the arrow, outputs right
    terms      := term ("," term)*          one term per tensor, in node order
    term       := "?" | "..." | token*      tokens separated by spaces; none: a scalar
    token      := "*" | name suffix?
    name       := [a-z]+                    letters only (the namer appends a number)
    suffix     := "+" | "!"

Meaning:

- A **name** is one label: every dim carrying it is one iteration dim of the op, split
  alike. `name+` marks a **sum** label (contracted: a split leaves the outputs pending
  partial sums); it may not appear in an output. `name!` marks a **whole** label (never
  split). A name carries the same suffix wherever it appears.
- `*` stands for the **broadcast dims**: however many dims the tensor has beyond its
  named tokens (at most one `*` per term). The output's `*` dims get fresh labels; each
  input's `*` dims are right-aligned against them (numpy broadcasting), and a dim whose
  size differs from the output dim it aligns with (broadcast from size 1) gets a fresh
  *whole* label of its own. Every output `*` carries the same labels, so outputs with a
  `*` have equal broadcast ranks; inputs may use `*` only if an output does.
- `?` is a tensor that is **not data** (a target shape, bounds, a type donor): labelled
  None, it stays replicated.
- `...` as the last input term repeats the term before it for every further input
  (variadic ops: Sum, Max, Mean, ...).
- Terms past the node's last input or output are ignored (omitted optional tensors); an
  omitted tensor inside the node ("") is labelled None. A node with more tensors than
  terms, or a tensor whose rank its term cannot take, is declined (`NoRule`): the op is
  then planned replicated.

Names: split labels are plan-file keys, so they are handed out in a fixed order by one
counter over the whole annotation: first the sum labels, in order of first appearance
(`k+` -> `k0`); then the output's `*` dims (`d1`, `d2`, ...); then, input by input, the
whole labels of dims broadcast from size 1 (`w3`, ...); then every other name in order of
first appearance (`m` -> `m4`, `n` -> `n5`). This is the order shardplan's hand-written
labellings always used, so plan files written before the annotations still apply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from planner.graph import OpNode, TensorInfo
from planner.ops.labels import DimLabels, Labels, Namer, NoRule, broadcast_labels, shape_of

_NAME = re.compile(r"[a-z]+")
Shape = tuple[int, ...]


class AnnotationError(ValueError):
    """An annotation that does not follow the grammar (a bug in the registry, not input)."""


@dataclass(frozen=True)
class Token:
    """One dim of a term: a named label (`name`) or the broadcast dims (`name` None)."""

    name: str | None
    sum: bool = False
    whole: bool = False


@dataclass(frozen=True)
class Term:
    """One tensor's dims; `tokens` None for a tensor that is not data (`?`)."""

    tokens: tuple[Token, ...] | None

    @property
    def has_star(self) -> bool:
        return self.tokens is not None and any(t.name is None for t in self.tokens)

    @property
    def named(self) -> int:
        return sum(1 for t in self.tokens or () if t.name is not None)


def _parse_term(text: str, where: str) -> Term:
    words = text.split()
    if words == ["?"]:
        return Term(None)
    tokens: list[Token] = []
    for word in words:
        if word == "*":
            tokens.append(Token(None))
            continue
        suffix = word[-1] if word[-1] in "+!" else ""
        name = word[:-1] if suffix else word
        if not _NAME.fullmatch(name):
            raise AnnotationError(f"{where}: {word!r} is not a label (lower-case letters, "
                                  f"optionally followed by + or !)")
        tokens.append(Token(name, sum=suffix == "+", whole=suffix == "!"))
    if sum(1 for t in tokens if t.name is None) > 1:
        raise AnnotationError(f"{where}: a term has at most one *")
    return Term(tuple(tokens))


@dataclass(frozen=True)
class Annotation:
    """A parsed annotation; calling it labels one op instance."""

    text: str
    inputs: tuple[Term, ...]
    outputs: tuple[Term, ...]
    variadic: bool  # the last input term repeats for every further input
    sum_names: tuple[str, ...]  # in order of first appearance
    other_names: tuple[str, ...]  # every other name, in order of first appearance
    whole_names: frozenset[str]
    _memo: dict[tuple[tuple[Shape | None, ...], tuple[Shape | None, ...]],
                DimLabels | NoRule] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, text: str) -> Annotation:
        where = f"annotation {text!r}"
        if text.count("->") != 1:
            raise AnnotationError(f"{where}: needs exactly one '->'")
        left, right = text.split("->")
        input_texts = [part.strip() for part in left.split(",")]
        variadic = input_texts[-1] == "..."
        if variadic:
            input_texts.pop()
            if not input_texts:
                raise AnnotationError(f"{where}: '...' repeats the term before it")
        if "..." in input_texts or "..." in right:
            raise AnnotationError(f"{where}: '...' may only be the last input term")
        inputs = tuple(_parse_term(part, where) for part in input_texts)
        outputs = tuple(_parse_term(part.strip(), where) for part in right.split(","))
        suffixes: dict[str, tuple[bool, bool]] = {}
        order: list[str] = []
        for term in (*inputs, *outputs):
            for token in term.tokens or ():
                if token.name is None:
                    continue
                kind = (token.sum, token.whole)
                if suffixes.setdefault(token.name, kind) != kind:
                    raise AnnotationError(f"{where}: {token.name} carries different suffixes")
                if token.name not in order:
                    order.append(token.name)
        for term in outputs:
            for token in term.tokens or ():
                if token.sum:
                    raise AnnotationError(f"{where}: sum label {token.name}+ in an output")
        if any(t.has_star for t in inputs) and not any(t.has_star for t in outputs):
            raise AnnotationError(f"{where}: inputs use * but no output does")
        return cls(
            text=text, inputs=inputs, outputs=outputs, variadic=variadic,
            sum_names=tuple(n for n in order if suffixes[n][0]),
            other_names=tuple(n for n in order if not suffixes[n][0]),
            whole_names=frozenset(n for n in order if suffixes[n][1]),
        )

    def _terms(self, terms: tuple[Term, ...], count: int, repeat: bool) -> tuple[Term, ...]:
        if count <= len(terms):
            return terms[:count]
        if not repeat:
            raise NoRule  # more tensors than the annotation describes
        return terms + (terms[-1],) * (count - len(terms))

    def __call__(self, node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
        """The instance's labels; they depend on its tensors' shapes alone, so are memoised
        by them (a model repeats the same few shapes in every layer)."""
        key = (tuple(tuple(tensors[name].shape) if name else None for name in node.inputs),
               tuple(tuple(tensors[name].shape) if name else None for name in node.outputs))
        found = self._memo.get(key)
        if found is None:
            if len(self._memo) > 100_000:
                self._memo.clear()
            found = self._memo[key] = self._label(*key)
        if isinstance(found, NoRule):
            raise NoRule
        return found

    def _label(self, in_shapes: tuple[Shape | None, ...],
               out_shapes: tuple[Shape | None, ...]) -> DimLabels | NoRule:
        try:
            return self._labels(in_shapes, out_shapes)
        except NoRule as declined:
            return declined

    def _labels(self, in_shapes: tuple[Shape | None, ...],
                out_shapes: tuple[Shape | None, ...]) -> DimLabels:
        in_terms = self._terms(self.inputs, len(in_shapes), self.variadic)
        out_terms = self._terms(self.outputs, len(out_shapes), False)
        namer = Namer()
        names = {name: namer.fresh(name) for name in self.sum_names}
        star_out = next((_star_span(term, shape)
                         for term, shape in zip(out_terms, out_shapes, strict=True)
                         if shape is not None and term.has_star), None)
        star_in = [_star_span(term, shape) if shape is not None and term.has_star else None
                   for term, shape in zip(in_terms, in_shapes, strict=True)]
        if star_out is None and any(span is not None for span in star_in):
            raise NoRule  # the output that carries the broadcast dims is omitted
        present = [span for span in star_in if span is not None]
        if star_out is not None and any(len(span) > len(star_out) for span in present):
            raise NoRule  # an input cannot broadcast against a smaller output
        labelled, out_star, whole = broadcast_labels(present, star_out or (), namer)
        for name in self.other_names:
            names[name] = namer.fresh(name)
        whole |= {names[name] for name in self.whole_names}
        broadcast = iter(labelled)
        inputs = tuple(
            _expand(term, names, next(broadcast) if span is not None else (), shape)
            if shape is not None else None
            for term, shape, span in zip(in_terms, in_shapes, star_in, strict=True))
        outputs: list[Labels | None] = []
        for term, shape in zip(out_terms, out_shapes, strict=True):
            if shape is not None and term.has_star and len(_star_span(term, shape)) != len(
                    out_star):
                raise NoRule  # outputs with unequal broadcast ranks
            outputs.append(_expand(term, names, out_star, shape) if shape is not None else None)
        return DimLabels(inputs, tuple(outputs),
                         sum_labels=frozenset(names[n] for n in self.sum_names),
                         whole_labels=frozenset(whole))


def _star_span(term: Term, shape: Shape) -> Shape:
    """The sizes of the dims the term's `*` stands for (NoRule when the rank cannot fit)."""
    assert term.tokens is not None
    index = next(i for i, t in enumerate(term.tokens) if t.name is None)
    span = len(shape) - term.named
    if span < 0:
        raise NoRule
    return shape[index:index + span]


def _expand(term: Term, names: Mapping[str, str], star: Labels, shape: Shape) -> Labels | None:
    """The term's labels for a tensor of `shape` (NoRule when its rank does not fit)."""
    if term.tokens is None:
        return None
    if not term.has_star and len(shape) != term.named:
        raise NoRule
    labels: list[str] = []
    for token in term.tokens:
        if token.name is None:
            labels += star
        else:
            labels.append(names[token.name])
    return tuple(labels)


@dataclass(frozen=True)
class RankCases:
    """One annotation per pattern of vector (rank-1) operands, as MatMul needs.

    Keys name each of the first operands `vector` or `matrix` (rank 2 or more), e.g.
    `"vector, matrix"`; the instance's pattern picks the annotation.
    """

    cases: Mapping[tuple[bool, ...], Annotation]

    @classmethod
    def parse(cls, cases: Mapping[str, str]) -> RankCases:
        parsed: dict[tuple[bool, ...], Annotation] = {}
        for key, text in cases.items():
            kinds = [part.strip() for part in key.split(",")]
            if any(kind not in ("vector", "matrix") for kind in kinds):
                raise AnnotationError(f"rank case {key!r}: each operand is vector or matrix")
            parsed[tuple(kind == "vector" for kind in kinds)] = Annotation.parse(text)
        return cls(parsed)

    def __call__(self, node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels:
        width = len(next(iter(self.cases)))
        key = tuple(len(shape_of(tensors, name)) == 1 for name in node.inputs[:width])
        annotation = self.cases.get(key)
        if annotation is None:
            raise NoRule
        return annotation(node, tensors)
