"""template.yaml, written from one declaration of each channel (development only).

The stack names each channel in about a dozen places: its function, its
reserved-concurrency parameter, the dispatcher's map of channels to functions
and its right to invoke them, an Errors alarm, the throttles alarm, three
dashboard widgets and two outputs. ``channels.yaml`` declares each channel
once; ``template.yaml.j2`` is the rest of the template, written by hand, with
a loop wherever the channels (or every function) repeat. ``make template``
renders the two into ``template.yaml``, which is checked in: SAM, cfn-lint,
checkov, ``outbox invoke``, the configuration reference and the template tests
read it as before. tests/template/test_generated.py fails when it is not what
the generator writes.

Why a generator, not CloudFormation's ``Fn::ForEach`` (AWS::LanguageExtensions):
``Fn::ForEach`` cannot be used in Parameters or Metadata (the concurrency
parameters, the console's parameter groups) and cannot repeat part of a string
(the dispatcher's CHANNEL_FUNCTIONS, the dashboard body); the SAM CLI expands
it locally only from 1.160 on and only when asked (``--language-extensions``);
and every other reader of template.yaml here (samtranslator in ``outbox
invoke``, docgen, cfn-lint, checkov, the tests) would have to expand it first.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TEMPLATE = ROOT / "template.yaml"
SOURCE = HERE / "template.yaml.j2"
CHANNELS = HERE / "channels.yaml"

# The functions that are not channels, in the template's order: the dispatcher,
# reaper and migrate functions come before the channels, feedback after them.
FUNCTIONS_BEFORE = ("Dispatcher", "Reaper", "Migrate")
FUNCTIONS_AFTER = ("Feedback",)
# CloudWatch reads at most 10 metrics in one alarm: ThrottlesAlarm sums every
# function's throttles but the dispatcher's.
ALARM_METRICS_LIMIT = 10

_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")  # a channel's name (outbox_message.channel)
_TITLE = re.compile(r"^[A-Z][A-Za-z0-9]*$")  # part of a logical id
_TOP_LEVEL_KEY = re.compile(r"^([A-Za-z0-9]+):", re.M)


class DeclarationError(ValueError):
    """channels.yaml declares something the template cannot hold."""


@dataclass(frozen=True)
class Channel:
    """One entry of channels.yaml (its head comment says what each field is)."""

    name: str
    title: str
    description: str
    concurrency: int
    parameters: str = ""
    conditions: str = ""
    environment: str = ""
    policies: str = ""

    @property
    def function(self) -> str:
        return f"{self.title}Function"

    @property
    def concurrency_parameter(self) -> str:
        return f"{self.title}Concurrency"

    @property
    def parameter_names(self) -> list[str]:
        return _TOP_LEVEL_KEY.findall(textwrap.dedent(self.parameters))


def load_channels(path: Path = CHANNELS) -> list[Channel]:
    """The channels path declares, checked: a bad entry is a DeclarationError naming it."""
    return parse_channels(path.read_text(), path.name)


def parse_channels(text: str, source: str = CHANNELS.name) -> list[Channel]:
    """The channels of a list in channels.yaml's form (source names it in errors)."""
    entries = yaml.safe_load(text)
    if not isinstance(entries, list):
        raise DeclarationError(f"{source}: a list of channels, one entry each")
    fields = set(Channel.__dataclass_fields__)
    channels = []
    for number, entry in enumerate(entries, 1):
        where = f"{source}, channel {number}"
        if not isinstance(entry, dict):
            raise DeclarationError(f"{where}: an entry is a mapping of {sorted(fields)}")
        unknown = sorted(set(entry) - fields)
        if unknown:
            raise DeclarationError(f"{where}: unknown field {', '.join(unknown)}")
        try:
            channel = Channel(**entry)
        except TypeError as exc:  # a required field is missing
            raise DeclarationError(f"{where}: {exc}") from None
        channels.append(channel)
    check(channels)
    return channels


def check(channels: Sequence[Channel]) -> None:
    """Refuse channels that would render a template CloudFormation refuses."""
    for channel in channels:
        if not _NAME.match(str(channel.name)):
            raise DeclarationError(f"channel name {channel.name!r} is not {_NAME.pattern}")
        if not _TITLE.match(str(channel.title)):
            raise DeclarationError(
                f"{channel.name}: title {channel.title!r} is not {_TITLE.pattern}"
            )
        concurrency = channel.concurrency
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise DeclarationError(f"{channel.name}: concurrency is a whole number of 1 or more")
        for what in ("description", "parameters", "conditions", "environment", "policies"):
            if not isinstance(getattr(channel, what), str):
                raise DeclarationError(f"{channel.name}: {what} is text")
    for what in ("name", "title"):
        seen = [getattr(c, what) for c in channels]
        twice = sorted({v for v in seen if seen.count(v) > 1})
        if twice:
            raise DeclarationError(f"channel {what} declared twice: {', '.join(twice)}")
    taken = {*FUNCTIONS_BEFORE, *FUNCTIONS_AFTER} & {c.title for c in channels}
    if taken:
        raise DeclarationError(f"title {', '.join(sorted(taken))} is a function of the relay")
    throttled = len(FUNCTIONS_BEFORE) - 1 + len(channels) + len(FUNCTIONS_AFTER)
    if throttled > ALARM_METRICS_LIMIT:
        raise DeclarationError(
            f"ThrottlesAlarm would read {throttled} metrics, more than CloudWatch's "
            f"{ALARM_METRICS_LIMIT} in one alarm: split it in template.yaml.j2"
        )


def _block(text: str, width: int) -> str:
    """YAML of a declaration, placed at a column of the template."""
    return textwrap.indent(textwrap.dedent(text).strip("\n"), " " * width)


def _scalar(text: str) -> str:
    """A string as a YAML value: plain when YAML reads it back unchanged, else quoted."""
    if yaml.safe_load(f"value: {text}") == {"value": text}:
        return text
    return json.dumps(text)


def _sub(name: str) -> str:
    """A name as a Fn::Sub variable: ${name}."""
    return "${" + name + "}"


def render(channels: Sequence[Channel] | None = None) -> str:
    """template.yaml's text for the channels (by default, those channels.yaml declares)."""
    if channels is None:
        channels = load_channels()
    check(channels)
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # noqa: S701 (YAML, never HTML)
    )
    environment.filters.update(block=_block, scalar=_scalar, sub=_sub)
    context: dict[str, Any] = {
        "channels": channels,
        "functions": [*FUNCTIONS_BEFORE, *(c.title for c in channels), *FUNCTIONS_AFTER],
    }
    return environment.get_template(SOURCE.name).render(context)
