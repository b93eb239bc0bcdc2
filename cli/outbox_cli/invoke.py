"""Run a function of template.yaml in this process: the Docker-free
counterpart of ``sam local invoke``.

The template is read the way the SAM CLI reads it, with AWS's own SAM
translator (``samtranslator``): ``Globals`` merged into the function by its
Globals plugin, parameter defaults and ``--parameter-overrides`` by its
``SamParameterValues``, ``Ref``/``Fn::Sub`` by its intrinsics resolver. As in
``sam local``, a ``Ref`` to a resource is its logical id, the pseudo
parameters have local values (account 123456789012, stack ``local``), and
conditions are evaluated so that ``Fn::If`` picks its branch; what is left is
the condition and list functions (Fn::Equals/Not/And/Or, Fn::Join/Select/
Split) over literal values, evaluated here.

A variable of the function's environment takes its value from the
``--env-vars`` file (its ``Parameters``, then the function's own section),
else from the shell, else from the template; one that nothing resolves is
left unset and said so. Variables the template does not declare are not
passed from the file (as in SAM), but this process's environment reaches the
handler as it is, so ``DATABASE_URL`` and ``AWS_ENDPOINT_URL`` come from the
shell.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import ipaddress
import json
import logging
import os
import re
import shlex
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from outbox.errors import OutboxError

from . import missing_extra

FUNCTION_TYPE = "AWS::Serverless::Function"
LAYER_TYPE = "AWS::Serverless::LayerVersion"
DEFAULT_TIMEOUT_SECONDS = 3
DEFAULT_MEMORY_MB = 128
ACCOUNT_ID = "123456789012"
# The pseudo parameters `sam local` gives a template (besides AWS::Region and
# AWS::Partition, which the translator derives from the region).
LOCAL_PSEUDO_PARAMETERS = {
    "AWS::AccountId": ACCOUNT_ID,
    "AWS::StackName": "local",
    "AWS::StackId": f"arn:aws:cloudformation:us-east-1:{ACCOUNT_ID}:stack/local/"
    "51af3dc0-da77-11e4-872e-1234567db123",
    "AWS::URLSuffix": "localhost",
}
NO_VALUE = {"Ref": "AWS::NoValue"}
PROGRESS_EVERY_SECONDS = 10.0


class InvokeError(OutboxError):
    """The function cannot be run as asked; the message says why."""


class LambdaContext:
    """The Lambda context object, with a real deadline from the function's Timeout."""

    def __init__(
        self,
        function_name: str,
        timeout_seconds: float,
        memory_mb: int = DEFAULT_MEMORY_MB,
        region: str | None = None,
    ) -> None:
        region = region or os.environ.get("AWS_REGION") or "us-east-1"
        self._deadline = time.monotonic() + timeout_seconds
        self.function_name = function_name
        self.function_version = "$LATEST"
        self.invoked_function_arn = f"arn:aws:lambda:{region}:{ACCOUNT_ID}:function:{function_name}"
        self.memory_limit_in_mb = memory_mb
        self.aws_request_id = str(uuid.uuid4())
        self.log_group_name = f"/aws/lambda/{function_name}"
        self.log_stream_name = time.strftime("%Y/%m/%d/[$LATEST]") + uuid.uuid4().hex
        self.identity = None
        self.client_context = None

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


@dataclass
class FunctionSpec:
    logical_id: str
    handler: str
    code_dir: Path
    timeout_seconds: float
    memory_mb: int
    environment: dict[str, str]
    layer_dirs: list[Path] = field(default_factory=list)
    # Variables nothing resolved, each with the reason ("parameter X has no default").
    unresolved: dict[str, str] = field(default_factory=dict)
    # Where each variable's value came from: env-vars, shell, template or local-default.
    sources: dict[str, str] = field(default_factory=dict)
    function_name: str | None = None
    # Sections of the env vars file that name no function of the template (a typo?).
    ignored_env_sections: list[str] = field(default_factory=list)


# --- reading the template -------------------------------------------------------


def load_template(path: Path) -> dict[str, Any]:
    """Parse a CloudFormation/SAM template, intrinsic tags as ``{"Ref": ...}`` /
    ``{"Fn::Sub": ...}`` dicts (the translator's own YAML constructor, on a
    loader of our own so that PyYAML's SafeLoader is left as it is)."""
    try:
        import yaml
        from samtranslator.yaml_helper import intrinsics_multi_constructor
    except ImportError as exc:  # pragma: no cover - both come with the local extra
        raise InvokeError(
            missing_extra("reading template.yaml", "local", "yaml", "samtranslator") or str(exc)
        ) from None

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", intrinsics_multi_constructor)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvokeError(f"cannot read template {path}: {exc.strerror or exc}") from None
    try:
        document = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise InvokeError(f"template {path} is not valid YAML: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("Resources"), dict):
        raise InvokeError(f"template {path} has no Resources section")
    return document


def function_names(template: Mapping[str, Any]) -> list[str]:
    return sorted(
        name
        for name, resource in template["Resources"].items()
        if isinstance(resource, dict) and resource.get("Type") == FUNCTION_TYPE
    )


_OVERRIDE_LONG = re.compile(r"^ParameterKey=([^,]+),ParameterValue=(.*)$", re.DOTALL)
_OVERRIDE_SHORT = re.compile(r"^([A-Za-z0-9]+)=(.*)$", re.DOTALL)


def parse_parameter_overrides(texts: Sequence[str]) -> dict[str, str]:
    """``--parameter-overrides`` in SAM's syntax: space-separated ``Key=Value``
    or ``ParameterKey=Key,ParameterValue=Value`` pairs, values quoted when they
    hold spaces; the option may be repeated."""
    values: dict[str, str] = {}
    for text in texts:
        try:
            pairs = shlex.split(text)
        except ValueError as exc:
            raise InvokeError(f"--parameter-overrides {text!r}: {exc}") from None
        for pair in pairs:
            match = _OVERRIDE_LONG.match(pair) or _OVERRIDE_SHORT.match(pair)
            if match is None:
                raise InvokeError(
                    f"--parameter-overrides: {pair!r} is not Key=Value "
                    "or ParameterKey=Key,ParameterValue=Value"
                )
            values[match.group(1)] = match.group(2)
    return values


class Resolver:
    """Parameter values and conditions of a template, and the resolution of a
    property value with them."""

    def __init__(
        self,
        template: Mapping[str, Any],
        overrides: Mapping[str, str] | None = None,
        region: str | None = None,
    ) -> None:
        import boto3
        from samtranslator.sdk.parameter import SamParameterValues

        declared = template.get("Parameters") or {}
        unknown = sorted(set(overrides or {}) - set(declared))
        if unknown:
            raise InvokeError(
                f"--parameter-overrides: the template has no parameter {', '.join(unknown)}"
                f" (it has: {', '.join(sorted(declared)) or 'none'})"
            )
        values = SamParameterValues({**LOCAL_PSEUDO_PARAMETERS, **(overrides or {})})
        values.add_default_parameter_values(dict(template))
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        values.add_pseudo_parameter_values(boto3.session.Session(region_name=region or "us-east-1"))
        self.parameters: dict[str, Any] = values.parameter_values
        for name, definition in declared.items():
            # A list parameter's Ref is a list (its value is comma-separated).
            kind = str((definition or {}).get("Type", ""))
            value = self.parameters.get(name)
            if (kind.startswith("List<") or kind == "CommaDelimitedList") and isinstance(
                value, str
            ):
                self.parameters[name] = [item.strip() for item in value.split(",")]
            elif isinstance(value, int | float) and not isinstance(value, bool):
                # CloudFormation hands every parameter on as a string (a Number
                # too), which is what Fn::Sub insists on.
                self.parameters[name] = str(value)
        self.declared_parameters = set(declared)
        # `sam local` resolves a Ref to a resource as its logical id (how
        # `sam local start-lambda` names the functions it serves).
        self._symbols = {
            **{name: name for name in template["Resources"]},
            **self.parameters,
        }
        self._condition_source = template.get("Conditions") or {}
        self.conditions: dict[str, bool | None] = {}
        for name in self._condition_source:
            self.conditions[name] = self._condition(name, set())

    def resolve(self, value: Any) -> Any:
        """``value`` with every Ref, Sub and If that can be resolved locally
        resolved; what cannot stays an intrinsic dict."""
        from samtranslator.intrinsics.resolver import IntrinsicsResolver

        resolved = IntrinsicsResolver(self._symbols).resolve_parameter_refs(copy.deepcopy(value))
        return self._finish(resolved)

    def _finish(self, value: Any) -> Any:
        if isinstance(value, dict):
            if len(value) == 1:
                ((key, arg),) = value.items()
                if key == "Fn::If" and isinstance(arg, list) and len(arg) == 3:
                    chosen = self.conditions.get(arg[0]) if isinstance(arg[0], str) else None
                    if chosen is not None:
                        return self._finish(arg[1] if chosen else arg[2])
                if key == "Fn::Sub" and isinstance(arg, str) and "${" not in arg.replace("${!", ""):
                    return arg.replace("${!", "${")
                if key in ("Fn::Join", "Fn::Select", "Fn::Split"):
                    literal = _list_function(key, self._finish(arg))
                    if literal is not None:
                        return literal
            items = {k: self._finish(v) for k, v in value.items()}
            return {k: v for k, v in items.items() if v != NO_VALUE}
        if isinstance(value, list):
            return [v for v in (self._finish(v) for v in value) if v != NO_VALUE]
        return value

    def _condition(self, name: str, seen: set[str]) -> bool | None:
        """True/False when the condition can be decided locally, else None."""
        if name in self.conditions:
            return self.conditions[name]
        if name in seen or name not in self._condition_source:
            return None
        return self._truth(self.resolve(self._condition_source[name]), seen | {name})

    def _truth(self, expr: Any, seen: set[str]) -> bool | None:
        # The condition functions over values the resolver already made literal.
        if not isinstance(expr, dict) or len(expr) != 1:
            return None
        ((key, arg),) = expr.items()
        if key == "Condition" and isinstance(arg, str):
            return self._condition(arg, seen)
        if key == "Fn::Equals" and isinstance(arg, list) and len(arg) == 2:
            left, right = (_scalar(a) for a in arg)
            return None if left is None or right is None else left == right
        if not isinstance(arg, list):
            return None
        parts = [self._truth(a, seen) for a in arg]
        if None in parts:
            return None
        if key == "Fn::Not" and len(parts) == 1:
            return not parts[0]
        if key == "Fn::And":
            return all(parts)
        if key == "Fn::Or":
            return any(parts)
        return None

    def unresolved_reason(self, value: Any) -> str:
        """Why ``value`` (still an intrinsic) could not be resolved."""
        refs = [r for r in _refs(value) if r not in self._symbols and not r.startswith("AWS::")]
        missing = [r for r in refs if r in self.declared_parameters]
        if missing:
            return f"parameter {missing[0]} has no default (--parameter-overrides {missing[0]}=...)"
        function = next(iter(value)) if isinstance(value, dict) and value else "intrinsic"
        return f"{function} has no local value"


def _list_function(key: str, arg: Any) -> Any:
    """Fn::Join, Fn::Select and Fn::Split over literal arguments; None otherwise."""
    if not isinstance(arg, list) or len(arg) != 2:
        return None
    first, second = arg
    if key == "Fn::Join" and isinstance(first, str) and isinstance(second, list):
        parts = [_scalar(item) for item in second]
        return None if None in parts else first.join(str(p) for p in parts)
    if key == "Fn::Split" and isinstance(first, str) and first and isinstance(second, str):
        return second.split(first)
    if key == "Fn::Select" and isinstance(second, list):
        try:
            return second[int(first)]
        except (TypeError, ValueError, IndexError):
            return None
    return None


def _scalar(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    return None


def _refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, arg in value.items():
            if key == "Ref" and isinstance(arg, str):
                yield arg
            elif key == "Fn::Sub":
                text = arg[0] if isinstance(arg, list) and arg else arg
                if isinstance(text, str):
                    yield from (m.split(".")[0] for m in re.findall(r"\$\{([^!}][^}]*)\}", text))
            yield from _refs(arg)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


def _number(value: Any) -> float | None:
    """A numeric property; parameter values (overrides above all) arrive as strings."""
    if isinstance(value, bool):
        return None
    try:
        return float(value) if isinstance(value, int | float | str) else None
    except ValueError:
        return None


def _env_string(value: Any) -> str | None:
    """A variable's value as Lambda gets it (SAM's stringify), None when it is
    still an intrinsic."""
    if isinstance(value, dict | list) or value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _local_dir(base: Path, value: Any) -> Path | None:
    if isinstance(value, str) and "://" not in value:
        return (base / value).resolve()
    return None


def _is_local_url(url: str | None) -> bool:
    """A database URL on this machine: a loopback host, or a unix socket (no host)."""
    if not url:
        return False
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        host = make_url(url).host
    except ArgumentError:
        return False
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _merged_properties(template: Mapping[str, Any], logical_id: str) -> dict[str, Any]:
    """The function's properties with ``Globals.Function`` merged in by the
    translator's Globals plugin (SAM's rules: maps merge, lists concatenate,
    the function's own value wins)."""
    from samtranslator.model.exceptions import ExceptionWithMessage
    from samtranslator.plugins.globals.globals import Globals

    resource = template["Resources"][logical_id]
    properties = copy.deepcopy(resource.get("Properties") or {})
    try:
        merged = Globals(copy.deepcopy(dict(template))).merge(
            FUNCTION_TYPE, properties, logical_id, resource.get("IgnoreGlobals")
        )
    except ExceptionWithMessage as exc:
        raise InvokeError(f"template Globals: {exc.message}") from None
    return dict(merged)


def function_spec(
    template: Mapping[str, Any],
    template_dir: Path,
    name: str,
    env_vars: Mapping[str, Any] | None = None,
    shell: Mapping[str, str] | None = None,
    parameter_overrides: Mapping[str, str] | None = None,
) -> FunctionSpec:
    """Everything needed to run function ``name`` (its logical id, or its FunctionName)."""
    resolver = Resolver(template, parameter_overrides)
    known = function_names(template)
    properties = {fn: resolver.resolve(_merged_properties(template, fn)) for fn in known}
    logical_id = name if name in known else None
    if logical_id is None:  # the FunctionName works too
        logical_id = next((fn for fn in known if properties[fn].get("FunctionName") == name), None)
    if logical_id is None:
        raise InvokeError(
            f"unknown function {name!r}; the template has: {', '.join(known) or 'none'}"
        )
    shell = os.environ if shell is None else shell
    props = properties[logical_id]
    function_name = (
        props.get("FunctionName") if isinstance(props.get("FunctionName"), str) else None
    )

    handler = props.get("Handler")
    if not isinstance(handler, str) or "." not in handler:
        raise InvokeError(f"function {logical_id} has no usable Handler (got {handler!r})")
    code_dir = _local_dir(template_dir, props.get("CodeUri", "."))
    if code_dir is None or not code_dir.is_dir():
        raise InvokeError(
            f"function {logical_id}: CodeUri {props.get('CodeUri')!r} is not a local folder"
        )

    unresolved: dict[str, str] = {}
    timeout = _number(props.get("Timeout", DEFAULT_TIMEOUT_SECONDS))
    if timeout is None:
        unresolved["Timeout"] = resolver.unresolved_reason(props.get("Timeout"))
        timeout = DEFAULT_TIMEOUT_SECONDS
    memory = _number(props.get("MemorySize", DEFAULT_MEMORY_MB)) or DEFAULT_MEMORY_MB

    declared = ((props.get("Environment") or {}).get("Variables")) or {}
    env_vars = env_vars or {}
    # SAM's precedence: the file's Parameters, then the function's own section
    # (by logical id, or by FunctionName).
    overrides: dict[str, Any] = {
        **(env_vars.get("Parameters") or {}),
        **((function_name and env_vars.get(function_name)) or {}),
        **(env_vars.get(logical_id) or {}),
    }
    environment: dict[str, str] = {}
    sources: dict[str, str] = {}
    for var, value in declared.items():
        if var in overrides:
            value, source = overrides[var], "env-vars"
        elif var in shell:
            value, source = shell[var], "shell"
        else:
            source = "template"
        text = _env_string(value)
        if text is None:
            unresolved[var] = resolver.unresolved_reason(value)
            continue
        environment[var], sources[var] = text, source

    # The template asks for verified TLS, as AWS needs; a Postgres on this
    # machine has none. Unless DB_SSLMODE was set on purpose (env file or
    # shell), a DATABASE_URL on loopback or a unix socket gets plaintext.
    database_url = environment.get("DATABASE_URL") or shell.get("DATABASE_URL")
    if sources.get("DB_SSLMODE") == "template" and _is_local_url(database_url):
        environment["DB_SSLMODE"], sources["DB_SSLMODE"] = "disable", "local-default"

    layer_dirs: list[Path] = []
    for layer in props.get("Layers") or []:
        resource = template["Resources"].get(layer) if isinstance(layer, str) else None
        if isinstance(resource, dict) and resource.get("Type") == LAYER_TYPE:
            content = resolver.resolve((resource.get("Properties") or {}).get("ContentUri"))
            layer_dir = _local_dir(template_dir, content)
            if layer_dir is not None and layer_dir.is_dir():
                layer_dirs.append(layer_dir)
    names = {*known, *(p.get("FunctionName") for p in properties.values())}
    ignored = sorted(k for k in env_vars if k != "Parameters" and k not in names)
    return FunctionSpec(
        logical_id,
        handler,
        code_dir,
        float(timeout),
        int(memory),
        environment,
        layer_dirs,
        unresolved,
        sources,
        function_name,
        ignored,
    )


def banner(spec: FunctionSpec) -> str:
    """The line said before the function runs: what runs, and for how long it may."""
    line = f"invoking {spec.logical_id} ({spec.handler}, Timeout {spec.timeout_seconds:g}s)"
    budget = spec.environment.get("DISPATCH_BUDGET_SECONDS")
    if "CHANNEL_FUNCTIONS" in spec.environment and budget is not None:  # the dispatcher
        with contextlib.suppress(ValueError):
            if float(budget) >= 5:
                line += (
                    f": it keeps claiming for DISPATCH_BUDGET_SECONDS={budget}s; "
                    '"DISPATCH_BUDGET_SECONDS": "0" under "DispatcherFunction" in '
                    "--env-vars makes it one pass"
                )
    return line


def channel_of(
    template: Mapping[str, Any],
    logical_id: str,
    parameter_overrides: Mapping[str, str] | None = None,
) -> str | None:
    """The channel a function sends for: the key the dispatcher's
    ``CHANNEL_FUNCTIONS`` map gives it in the template."""
    resolver = Resolver(template, parameter_overrides)
    for fn in function_names(template):
        variables = (
            resolver.resolve(_merged_properties(template, fn)).get("Environment") or {}
        ).get("Variables") or {}
        raw = variables.get("CHANNEL_FUNCTIONS")
        try:
            mapping = json.loads(raw) if isinstance(raw, str) else None
        except json.JSONDecodeError:
            continue
        if isinstance(mapping, dict):
            for channel, target in mapping.items():
                if target == logical_id:
                    return str(channel)
    return None


def claim_event(
    channel: str, limit: int, say: Callable[[str], None] | None = None
) -> Callable[[], dict[str, Any]]:
    """What the dispatcher would send: claim up to ``limit`` due rows of
    ``channel`` (with the function's LEASE_SECONDS and database settings, read
    from the environment once the function has started) and make the hand-off
    event of them."""

    def make() -> dict[str, Any]:
        from outbox import store
        from outbox.db import create_engine
        from outbox.handoff import HandOff
        from outbox.relay_settings import DatabaseSettings, RelaySettings

        settings = RelaySettings.from_env(os.environ)
        engine = create_engine(DatabaseSettings.from_env(os.environ), autocommit=True)
        try:
            with engine.begin() as conn:
                claims = store.claim(conn, limit, settings.lease_seconds, [channel])
        finally:
            engine.dispose()
        if not claims:
            raise InvokeError(f"--claim: no due pending {channel} message to claim")
        if say is not None:  # ids only: claim tokens stay out of every output but the event
            ids = ", ".join(str(c.id) for c in claims)
            say(f"claimed {len(claims)} {channel} message(s) for the hand-off event: ids {ids}")
        return HandOff(channel, tuple(claims)).to_event()

    return make


# --- running it -------------------------------------------------------------------


def load_handler(spec: FunctionSpec) -> Any:
    """Import the handler's module from the function folder (first on sys.path)."""
    module_path, _, attr = spec.handler.rpartition(".")
    file = spec.code_dir.joinpath(*module_path.split(".")).with_suffix(".py")
    if not file.is_file():
        raise InvokeError(f"function {spec.logical_id}: handler module {file} does not exist")
    for folder in reversed([spec.code_dir, *spec.layer_dirs]):
        if str(folder) in sys.path:
            sys.path.remove(str(folder))
        sys.path.insert(0, str(folder))
    module = load_module(file, f"outbox_fn_{spec.logical_id}")
    handler = getattr(module, attr, None)
    if not callable(handler):
        raise InvokeError(f"function {spec.logical_id}: {file.name} has no callable {attr!r}")
    return handler


def load_module(file: Path, name: str) -> ModuleType:
    """Import a file under its own module name (each function has its own app.py)."""
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:  # pragma: no cover
        raise InvokeError(f"cannot import {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@dataclass
class InvokeResult:
    result: Any = None
    error: dict[str, Any] | None = None
    traceback: str | None = None
    duration_seconds: float = 0.0
    timed_out: bool = False
    # "init" when the function failed at its cold start, "invoke" in the handler.
    phase: str = "invoke"
    # One line for an expected failure (no traceback then).
    summary: str | None = None


# SQLSTATE classes of a database that refused the session itself: connection
# exceptions, bad credentials, no such database.
_CONNECT_SQLSTATES = ("08", "28", "3D")


def _sqlstate(exc: BaseException | None) -> tuple[str | None, str]:
    """(SQLSTATE, message) of a pg8000 error, whose argument is the server's fields."""
    args = exc.args if exc is not None else ()
    fields = args[0] if args and isinstance(args[0], dict) else {}
    return fields.get("C"), str(fields.get("M") or exc)


def expected_failure(exc: BaseException) -> str | None:
    """One line for a failure the user can act on from its message alone (a
    setting, a bad event, a database or AWS endpoint that does not answer or
    refuses the session); None for anything else, which keeps its traceback."""
    import sqlalchemy.exc

    if isinstance(exc, OutboxError):
        return str(exc)
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        code, message = _sqlstate(exc.orig)
        connecting = isinstance(
            exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError
        ) or (code or "").startswith(_CONNECT_SQLSTATES)
        if connecting:
            hint = " (a local Postgres has no TLS: DB_SSLMODE=disable)" if "SSL" in message else ""
            return f"the database refused the connection: {message}" + (
                f" ({code})" if code else hint
            )
        if code == "42P01":  # undefined table: a database nobody migrated yet
            return (
                f"{message}: the database has no outbox schema yet "
                "(run `outbox migrate`, or invoke MigrateFunction)"
            )
        return None
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError

        if isinstance(exc, BotoCoreError):
            return str(exc)
    return None


def error_document(exc: BaseException, summary: str | None = None) -> dict[str, Any]:
    """What Lambda returns for an unhandled exception; an expected failure
    carries its one-line summary and no stack."""
    return {
        "errorMessage": summary or str(exc),
        "errorType": type(exc).__name__,
        "stackTrace": [] if summary else traceback.format_tb(exc.__traceback__),
    }


@contextlib.contextmanager
def logs_to_stderr() -> Iterator[None]:
    """Like `sam local invoke`: the function's logs go to stderr, so stdout
    carries only the result (and `outbox worker`'s report). Log handlers bound
    to stdout are pointed at stderr for the call (Powertools binds its handler
    to the stream at import)."""
    stdout_streams = {id(sys.stdout), id(sys.__stdout__)}
    moved: list[logging.StreamHandler[Any]] = []
    loggers = [
        logging.getLogger(),
        *(
            lg
            for lg in logging.Logger.manager.loggerDict.values()
            if isinstance(lg, logging.Logger)
        ),
    ]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and id(h.stream) in stdout_streams:
                moved.append(h)
    originals = [h.setStream(sys.stderr) for h in moved]
    try:
        yield
    finally:
        for h, stream in zip(moved, originals, strict=True):
            h.setStream(stream)


@contextlib.contextmanager
def _progress(
    spec: FunctionSpec, say: Callable[[str], None] | None, every: float
) -> Iterator[None]:
    """Say every ``every`` seconds that the function is still running."""
    if say is None:
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while not done.wait(every):
            say(
                f"{spec.logical_id} still running: {time.monotonic() - started:.0f}s "
                f"of its {spec.timeout_seconds:g}s Timeout"
            )

    thread = threading.Thread(target=tick, name="invoke-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def refuse_custom_resource_event(spec: FunctionSpec, event: Any) -> None:
    """A CloudFormation custom-resource event is answered at its ResponseURL,
    which the function only accepts as CloudFormation's own S3 bucket (so a
    forged event cannot send its answer anywhere): a local run could apply the
    migration but never answer. Refused before anything runs."""
    if isinstance(event, Mapping) and "ResponseURL" in event:
        raise InvokeError(
            f"{spec.logical_id}: this is a CloudFormation custom-resource event, answered "
            "only at CloudFormation's S3 ResponseURL, which a local run cannot reach; nothing "
            "ran: use events/migrate-invoke.json (a plain invoke that returns the revision) "
            "or `outbox migrate`"
        )


def invoke(
    spec: FunctionSpec,
    event: Any,
    *,
    progress: Callable[[str], None] | None = None,
    progress_every: float = PROGRESS_EVERY_SECONDS,
) -> InvokeResult:
    """Set the environment, import the handler (its cold start) and call it once;
    its stdout and logs go to stderr. ``event`` may be a callable, called after
    the cold start succeeded (a live claim is made only for a function that
    started)."""
    refuse_custom_resource_event(spec, event)
    os.environ.update(spec.environment)
    os.environ.update(
        {
            "AWS_SAM_LOCAL": "true",
            "AWS_LAMBDA_FUNCTION_NAME": spec.logical_id,
            "AWS_LAMBDA_FUNCTION_TIMEOUT": str(int(spec.timeout_seconds)),
            "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(spec.memory_mb),
            "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
        }
    )
    # A Lambda execution environment serves one function: its logger carries
    # no keys (correlation id, execution id) from another function's call.
    # Here the relay's logger is one object for every function invoked.
    from outbox.observability import logger as relay_logger

    relay_logger.clear_state()
    started = time.monotonic()
    outcome = InvokeResult(phase="init")
    try:
        with contextlib.redirect_stdout(sys.stderr), _progress(spec, progress, progress_every):
            handler = load_handler(spec)
            outcome.phase = "invoke"
            payload = event() if callable(event) else event
            # The deadline starts with the call, as Lambda's does after the init.
            context = LambdaContext(spec.logical_id, spec.timeout_seconds, spec.memory_mb)
            started = time.monotonic()
            with logs_to_stderr(), warnings.catch_warnings():
                # Powertools warns on every invocation that counted no metric; in
                # a local run that is noise, not a problem with the function.
                warnings.filterwarnings("ignore", "No application metrics to publish")
                outcome.result = handler(payload, context)
    except InvokeError:
        raise
    except Exception as exc:
        outcome.summary = expected_failure(exc)
        outcome.error = error_document(exc, outcome.summary)
        outcome.traceback = None if outcome.summary else traceback.format_exc()
    outcome.duration_seconds = time.monotonic() - started
    outcome.timed_out = outcome.duration_seconds > spec.timeout_seconds
    return outcome
