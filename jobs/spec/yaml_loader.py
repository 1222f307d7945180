"""Job-file YAML: pyyaml's safe loader with YAML 1.2 (core schema) scalars and no duplicate keys.

pyyaml implements YAML 1.1, where `1e-9` and `1e5` are text (a float needs a dot), `yes`/`no`/
`on`/`off` are booleans, `010` is octal, `1:20` is base 60 and `2024-01-02` a date. Job files
are read with the YAML 1.2 core schema instead, as a user expects: any decimal number with an
exponent or a leading dot is a float, only `true`/`false` are booleans, all else is text (`<<`
merge keys still work). A key given twice in one mapping is an error
(`DuplicateKeyError`, located at the second one) instead of silently keeping the last value.
Anchors and aliases (`<<: *base`) work, but a document whose aliases would expand past
`MAX_EXPANDED_NODES` values (a "billion laughs"), or refer to themselves, or that nests past
`MAX_DEPTH` is a `JobFileSizeError`: consumers (fingerprints, templates) expand aliases into copies.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.nodes import CollectionNode, MappingNode, Node

# YAML 1.2.2, section 10.3.2 (core schema tag resolution).
# \Z, not $: `$` also matches before a final newline.
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)\Z")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)\Z")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)\Z")
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))\Z")
_MERGE_TAG = "tag:yaml.org,2002:merge"
MAX_EXPANDED_NODES = 100_000  # a job file holds hundreds; a billion laughs holds 10**9
MAX_DEPTH = 200               # pyyaml composes recursively: deeper nesting would be a RecursionError


class DuplicateKeyError(ConstructorError):
    """A mapping names one key twice; `problem_mark` is the second occurrence."""

    def __init__(self, key: Any, first: Node, second: Node) -> None:
        super().__init__(None, None, f"duplicate key {key!r} (first on line {first.start_mark.line + 1})",
                         second.start_mark)
        self.key = key


class JobFileSizeError(ComposerError):
    """The document is too large once its aliases are expanded, refers to itself, or nests too deeply."""

    def __init__(self, problem: str, node: Optional[Node] = None) -> None:
        super().__init__(None, None, problem, node.start_mark if node is not None else None)


def _check_expansion(root: Node) -> None:
    """Count the values `root` expands to (aliases share nodes: each use counts again), without
    expanding anything: one pass over the distinct nodes, iterative, with each node's count memoised."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Node, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        if not isinstance(node, CollectionNode):
            sizes[key] = 1
            continue
        children = [child for pair in node.value for child in pair] if isinstance(node, MappingNode) else node.value
        if key not in on_path:  # first visit: its children first, then the node again
            if depth > MAX_DEPTH:
                raise JobFileSizeError(f"values nested more than {MAX_DEPTH} levels deep", node)
            on_path.add(key)
            stack.append((node, depth))
            for child in children:
                if id(child) in on_path:
                    raise JobFileSizeError("a recursive alias (a value that contains itself)", child)
                stack.append((child, depth + 1))
            continue
        on_path.discard(key)
        sizes[key] = 1 + sum(sizes[id(child)] for child in children)
        if sizes[key] > MAX_EXPANDED_NODES:
            raise JobFileSizeError(f"aliases expand to more than {MAX_EXPANDED_NODES:,} values", node)


class JobFileLoader(yaml.SafeLoader):
    """SafeLoader with core-schema scalars and duplicate-key detection (see the module docstring)."""

    def compose_document(self) -> Optional[Node]:
        node = super().compose_document()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *base` may be overridden by later keys
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not key_node:
                raise DuplicateKeyError(key, first, key_node)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Node) -> int:
        value = self.construct_scalar(node)
        try:
            if value.startswith("0o"):
                return int(value[2:], 8)
            if value.startswith("0x"):
                return int(value[2:], 16)
            return int(value, 10)  # "010" is ten: YAML 1.2 has no leading-zero octal
        except ValueError:  # only an explicit `!!int` tag gets here with a non-number
            raise ConstructorError(None, None, f"{value!r} is not an integer", node.start_mark) from None

    def construct_yaml_float(self, node: Node) -> float:
        value = self.construct_scalar(node)
        lowered = value.lower()
        if lowered in (".inf", "+.inf", "-.inf"):
            return float("-inf") if lowered.startswith("-") else float("inf")
        if lowered == ".nan":
            return float("nan")
        try:
            return float(value)
        except ValueError:  # only an explicit `!!float` tag gets here with a non-number
            raise ConstructorError(None, None, f"{value!r} is not a number", node.start_mark) from None


# Keep only the merge key of SafeLoader's YAML 1.1 implicit rules, then add the core schema's.
JobFileLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag == _MERGE_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _pattern, _first in (("bool", _BOOL, "tTfF"), ("null", _NULL, ["~", "n", "N", ""]),
                               ("int", _INT, "-+0123456789"), ("float", _FLOAT, "-+.0123456789")):
    JobFileLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", _pattern, list(_first))
JobFileLoader.add_constructor("tag:yaml.org,2002:int", JobFileLoader.construct_yaml_int)
JobFileLoader.add_constructor("tag:yaml.org,2002:float", JobFileLoader.construct_yaml_float)


def load_yaml(text: str) -> Any:
    """Parse one YAML document with `JobFileLoader`."""
    try:
        return yaml.load(text, Loader=JobFileLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:  # pyyaml's composer recurses per level, before _check_expansion sees the depth
        raise JobFileSizeError(f"values nested more than {MAX_DEPTH} levels deep") from None
