"""Rewrites the fusion passes share: a matched expression becomes one call of an op."""

from __future__ import annotations

import torch


def call_in_place_of(last: torch.fx.Node, target, args: tuple, dead: list[torch.fx.Node]) -> None:
    """``last``, the matched expression's final node, becomes ``target(*args)``: it keeps its
    name (which the program's outputs may use) and its value's shape and dtype, now laid out
    contiguous as the op returns it, whatever layout the expression's last op gave. ``dead``,
    the other matched nodes, are erased (users first)."""
    last.target, last.args, last.kwargs = target, args, {}
    last.meta["val"] = last.meta["val"].new_empty(last.meta["val"].shape)
    for node in dead:
        last.graph.erase_node(node)
