"""The configuration reference, made from ``outbox.settings`` and ``template.yaml``.

Every setting is declared once, in ``outbox.settings``; the template feeds most
of them from its parameters. This module writes both into Markdown tables, so
the reference cannot drift from either: a new setting or parameter appears by
itself the next time the site is built.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox.settings import SETTINGS, Setting

TEMPLATE = Path(__file__).resolve().parents[1] / "template.yaml"


def load_template(path: Path = TEMPLATE) -> dict[str, Any]:
    """The template as plain dicts and lists, its short-form tags (!Ref, !If, ...)
    read as their long forms, as CloudFormation reads them (the SAM
    translator's reader, which `outbox invoke` uses: the `local` extra has it)."""
    from outbox_cli.invoke import load_template as read

    return _plain(read(path))


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if isinstance(node, str):
        return str(node)
    return node


@dataclass
class Source:
    """Where the template takes a variable's value from, over all its functions."""

    parameters: list[str] = field(default_factory=list)  # !Ref'd parameters, in order
    built_from: list[str] = field(default_factory=list)  # parameters inside a !Sub
    pseudo: list[str] = field(default_factory=list)  # AWS::StackName, ...
    literals: list[str] = field(default_factory=list)  # fixed values
    resources: bool = False  # a resource of the stack (its name, its ARN)

    def add(self, items: list[str], item: str) -> None:
        if item not in items:
            items.append(item)


def variables(template: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(variable, value) for every variable the template sets: Globals, then each function."""
    yield from template["Globals"]["Function"]["Environment"]["Variables"].items()
    for resource in template["Resources"].values():
        if resource["Type"] == "AWS::Serverless::Function":
            props = resource.get("Properties", {})
            yield from props.get("Environment", {}).get("Variables", {}).items()


def sources(template: dict[str, Any]) -> dict[str, Source]:
    """Each variable the template sets, and what feeds it."""
    params = template["Parameters"]
    found: dict[str, Source] = {}

    def walk(node: Any, source: Source) -> None:
        if isinstance(node, dict) and set(node) == {"Ref"}:
            name = node["Ref"]
            if name == "AWS::NoValue":
                return
            if name in params:
                source.add(source.parameters, name)
            elif name.startswith("AWS::"):
                source.add(source.pseudo, name)
            else:
                source.resources = True
        elif isinstance(node, dict) and set(node) == {"Fn::If"}:
            for branch in node["Fn::If"][1:]:
                walk(branch, source)
        elif isinstance(node, dict) and set(node) == {"Fn::Join"}:
            walk(node["Fn::Join"][1], source)
        elif isinstance(node, dict) and set(node) == {"Fn::Sub"}:
            text = node["Fn::Sub"] if isinstance(node["Fn::Sub"], str) else node["Fn::Sub"][0]
            for name in re.findall(r"\$\{([A-Za-z0-9:]+)\}", text):
                if name in params:
                    source.add(source.built_from, name)
                elif name.startswith("AWS::"):
                    source.add(source.pseudo, name)
                else:
                    source.resources = True
        elif isinstance(node, dict) and set(node) == {"Fn::GetAtt"}:
            source.resources = True
        elif isinstance(node, list):
            for item in node:
                walk(item, source)
        elif isinstance(node, bool):
            source.add(source.literals, "true" if node else "false")
        elif node is not None:
            source.add(source.literals, str(node))

    for name, value in variables(template):
        walk(value, found.setdefault(name, Source()))
    return found


def _code(items: Iterable[str]) -> str:
    return ", ".join(f"`{item}`" for item in items)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def template_cell(setting: Setting[Any], source: Source | None, template: dict[str, Any]) -> str:
    """How the template sets a variable, for the reference table."""
    if source is None:
        return "never set: the default applies" if not setting.in_template else "not set"
    conditions = _conditions(template, setting.name)
    parts = []
    if source.parameters:
        cell = _code(source.parameters)
        parts.append(cell + (f" ({conditions})" if conditions else ""))
    if source.built_from:
        parts.append("built from " + _code(source.built_from))
    if source.pseudo:
        parts.append(
            ", ".join(
                "the stack's name" if p == "AWS::StackName" else f"`{p}`" for p in source.pseudo
            )
        )
    if source.resources:
        parts.append("the stack's own resources")
    if source.literals:
        parts.append("fixed " + _code(source.literals))
    return "; ".join(parts)


def _conditions(template: dict[str, Any], variable: str) -> str:
    """The DatabaseAuth choice a variable depends on (DB_SECRET_ARN with secret, ...)."""
    values = [value for name, value in variables(template) if name == variable]
    wanted = []
    for value in values:
        if isinstance(value, dict) and set(value) == {"Fn::If"}:
            condition = template.get("Conditions", {}).get(value["Fn::If"][0], {})
            match = re.search(r"'Ref': 'DatabaseAuth'\}, '(\w+)'", str(condition))
            if match and f"`DatabaseAuth={match[1]}`" not in wanted:
                wanted.append(f"`DatabaseAuth={match[1]}`")
    return ", ".join(wanted)


def default_cell(setting: Setting[Any]) -> str:
    local = setting.document(setting.default)
    cell = f"`{local}`" if local else "(none)"
    if setting.aws_default is not None:
        cell += f"; template: `{setting.aws_default}`"
    return cell


def settings_table(template: dict[str, Any], settings: Iterable[Setting[Any]] = SETTINGS) -> str:
    """Every declared setting: its variable, the template parameter that feeds it,
    its default and its meaning."""
    found = sources(template)
    rows = [
        "| environment variable | template parameter | default | meaning |",
        "|---|---|---|---|",
    ]
    for setting in settings:
        how = template_cell(setting, found.get(setting.name), template)
        rows.append(
            f"| `{setting.name}` | {_cell(how)} | {_cell(default_cell(setting))}"
            f" | {_cell(setting.meaning)} |"
        )
    return "\n".join(rows) + "\n"


def _mentions(node: Any, param: str) -> bool:
    """Whether a template node refers to ``param`` (!Ref, or ${param} in a !Sub)."""
    if isinstance(node, dict):
        if node.get("Ref") == param:
            return True
        return any(_mentions(v, param) for v in node.values())
    if isinstance(node, list):
        return any(_mentions(v, param) for v in node)
    return isinstance(node, str) and "${" + param + "}" in node


def _used_by(template: dict[str, Any], param: str) -> str:
    """What a parameter without a description sets, read from where it is used."""
    reserved = [
        name
        for name, resource in template["Resources"].items()
        if _mentions(resource.get("Properties", {}).get("ReservedConcurrentExecutions"), param)
    ]
    if reserved:
        return "reserved concurrency of " + _code(reserved)
    places = [
        f"{name} ({', '.join(key for key, v in section.items() if _mentions(v, param))})"
        for name, section in [("Globals", template.get("Globals", {}).get("Function", {}))]
        if _mentions(section, param)
    ]
    places += [f"`{n}`" for n, r in template["Resources"].items() if _mentions(r, param)]
    return "used by " + ", ".join(places) if places else ""


def parameters_table(template: dict[str, Any]) -> str:
    """The template's parameters that no variable takes as its value (they shape
    the stack: network, IAM grants, reserved concurrency, alarms), with their
    defaults and descriptions."""
    fed = {p for s in sources(template).values() for p in s.parameters}
    rows = ["| template parameter | default | meaning |", "|---|---|---|"]
    for name, param in template["Parameters"].items():
        if name in fed:
            continue
        default = param.get("Default")
        shown = f"`{default}`" if default not in (None, "") else "empty"
        meaning = str(param.get("Description") or _used_by(template, name))
        rows.append(f"| `{name}` | {_cell(shown)} | {_cell(meaning)} |")
    return "\n".join(rows) + "\n"
