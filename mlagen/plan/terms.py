"""Integer formulas written once and read two ways: evaluated on ints, or spelled out as C-like
text on `Term`s (`KernelPlan.grid` and `KernelPlan.grid_expr` share one formula this way, and
the C++ launcher translates the text).

A `Term` is a symbolic integer: `+`, `-`, `*`, `//` (spelled `/`, C's division of non-negative
ints) and `>` on Terms and ints build the text with the parentheses its precedence needs;
`ceil_div` and `select` take ints or Terms alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

# Precedence of a term's outermost operator: a term is parenthesized as an operand of a
# tighter operator.
_SELECT, _COMPARE, _ADD, _MUL, _ATOM = range(5)


@dataclass(frozen=True)
class Term:
    """A symbolic integer: its text and the precedence of its outermost operator."""

    text: str
    precedence: int = _ATOM

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: Term | int) -> Term:
        return _binary(self, "+", other, _ADD)

    def __radd__(self, other: int) -> Term:
        return _binary(other, "+", self, _ADD)

    def __sub__(self, other: Term | int) -> Term:
        return _binary(self, "-", other, _ADD)

    def __mul__(self, other: Term | int) -> Term:
        return _binary(self, "*", other, _MUL)

    def __rmul__(self, other: int) -> Term:
        return _binary(other, "*", self, _MUL)

    def __floordiv__(self, other: Term | int) -> Term:
        return _binary(self, "/", other, _MUL)

    def __gt__(self, other: Term | int) -> Term:
        return _binary(self, ">", other, _COMPARE)


def _operand(x: Term | int | bool, precedence: int, right: bool) -> str:
    """`x`'s text as an operand of an operator of `precedence`, parenthesized where it binds
    less tightly (on the right, also where it binds as tightly: the operators group left)."""
    if isinstance(x, int):
        return str(x)
    looser = x.precedence <= precedence if right else x.precedence < precedence
    return f"({x.text})" if looser else x.text


def _binary(a: Term | int, op: str, b: Term | int, precedence: int) -> Term:
    return Term(f"{_operand(a, precedence, False)} {op} {_operand(b, precedence, True)}", precedence)


N = TypeVar("N", int, Term)


def ceil_div(a: N, n: int) -> N:
    """a / n rounded up, for a non-negative `a` and a positive constant `n` (spelled
    `ceil(a / n)`)."""
    if isinstance(a, Term):
        return Term(f"ceil({_operand(a, _MUL, False)} / {n})")
    return -(-a // n)


def select(condition: bool | Term, then: N, otherwise: N) -> N:
    """`then` where `condition` holds, else `otherwise` (spelled `condition ? then : otherwise`)."""
    if isinstance(then, Term) and isinstance(otherwise, Term):
        parts = (_operand(x, _SELECT, True) for x in (condition, then, otherwise))
        return Term("{} ? {} : {}".format(*parts), _SELECT)
    return then if condition else otherwise
