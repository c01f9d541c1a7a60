"""A calculator tool for `rollout.tools` (jobs/dapo_tools_tiny.yaml): the policy may call it on
the bundled arithmetic questions instead of computing in its head."""

from __future__ import annotations

import ast
import operator

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
       ast.UAdd: operator.pos}


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses.

    Anything else (names, calls) is refused: the expression comes from the policy."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) ** min(abs(right), 64) > 10 ** 300):
                raise ValueError("power too large")  # (9**64)**64...: digits without end
            return OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    value = ev(ast.parse(expr, mode="eval").body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
