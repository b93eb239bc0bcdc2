"""Run a function of template.yaml in this process: the Docker-free
counterpart of ``sam local invoke``.

The template gives the function's Handler, CodeUri, layers, Timeout, memory and
environment (``Globals.Function`` merged under the function's own). Values
are resolved like SAM does: the ``--env-vars`` file (the function's section,
then ``Parameters``), then the shell, then the template's literal value; an
intrinsic (``!Ref``, ``!Sub``, ...) with nothing to resolve it is left unset.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from outbox.errors import OutboxError

FUNCTION_TYPE = "AWS::Serverless::Function"
DEFAULT_TIMEOUT_SECONDS = 3
DEFAULT_MEMORY_MB = 128


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
        self.invoked_function_arn = f"arn:aws:lambda:{region}:123456789012:function:{function_name}"
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
    skipped_variables: list[str] = field(default_factory=list)


def load_template(path: Path) -> dict[str, Any]:
    """Parse a CloudFormation/SAM template, keeping intrinsic tags as
    ``{"Ref": ...}`` / ``{"Fn::Sub": ...}`` dicts."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml comes with the dev extras
        raise InvokeError("reading template.yaml needs PyYAML (pip install pyyaml)") from None

    class Loader(yaml.SafeLoader):
        pass

    def intrinsic(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
        value: Any
        if isinstance(node, yaml.ScalarNode):
            value = loader.construct_scalar(node)
            if suffix == "GetAtt" and isinstance(value, str):
                value = value.split(".", 1)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_mapping(node, deep=True)
        return {suffix if suffix in ("Ref", "Condition") else f"Fn::{suffix}": value}

    Loader.add_multi_constructor("!", intrinsic)
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


def _local_dir(base: Path, value: Any) -> Path | None:
    if isinstance(value, str) and "://" not in value:
        return (base / value).resolve()
    return None


def function_spec(
    template: Mapping[str, Any],
    template_dir: Path,
    name: str,
    env_vars: Mapping[str, Any] | None = None,
    shell: Mapping[str, str] | None = None,
) -> FunctionSpec:
    """Everything needed to run function ``name`` (its logical id, or its FunctionName)."""
    known = function_names(template)
    logical_id = name if name in known else None
    if logical_id is None:  # allow the literal FunctionName too
        for candidate in known:
            if template["Resources"][candidate].get("Properties", {}).get("FunctionName") == name:
                logical_id = candidate
    if logical_id is None:
        raise InvokeError(
            f"unknown function {name!r}; the template has: {', '.join(known) or 'none'}"
        )
    shell = os.environ if shell is None else shell
    globals_ = (template.get("Globals") or {}).get("Function") or {}
    props = template["Resources"][logical_id].get("Properties") or {}

    def prop(key: str, default: Any = None) -> Any:
        return props.get(key, globals_.get(key, default))

    handler = prop("Handler")
    if not isinstance(handler, str) or "." not in handler:
        raise InvokeError(f"function {logical_id} has no usable Handler (got {handler!r})")
    code_dir = _local_dir(template_dir, prop("CodeUri", "."))
    if code_dir is None or not code_dir.is_dir():
        raise InvokeError(
            f"function {logical_id}: CodeUri {prop('CodeUri')!r} is not a local folder"
        )

    timeout = prop("Timeout", DEFAULT_TIMEOUT_SECONDS)
    memory = prop("MemorySize", DEFAULT_MEMORY_MB)
    timeout = float(timeout) if isinstance(timeout, int | float) else float(DEFAULT_TIMEOUT_SECONDS)
    memory = int(memory) if isinstance(memory, int) else DEFAULT_MEMORY_MB

    declared: dict[str, Any] = {}
    for source in (globals_, props):
        declared.update(((source.get("Environment") or {}).get("Variables")) or {})
    env_vars = env_vars or {}
    overrides: dict[str, Any] = {
        **(env_vars.get("Parameters") or {}),
        **(env_vars.get(logical_id) or {}),
    }
    environment: dict[str, str] = {}
    skipped: list[str] = []
    for var, value in declared.items():
        if var in overrides:
            environment[var] = str(overrides[var])
        elif var in shell:
            environment[var] = shell[var]
        elif isinstance(value, str | int | float | bool):
            environment[var] = str(value).lower() if isinstance(value, bool) else str(value)
        else:
            skipped.append(var)  # an intrinsic nothing resolves locally

    layer_dirs: list[Path] = []
    for layer in prop("Layers", []) or []:
        ref = layer.get("Ref") if isinstance(layer, dict) else None
        resource = template["Resources"].get(ref) if isinstance(ref, str) else None
        if isinstance(resource, dict):
            layer_dir = _local_dir(
                template_dir, (resource.get("Properties") or {}).get("ContentUri")
            )
            if layer_dir is not None and layer_dir.is_dir():
                layer_dirs.append(layer_dir)
    return FunctionSpec(
        logical_id, handler, code_dir, timeout, memory, environment, layer_dirs, skipped
    )


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


def error_document(exc: BaseException) -> dict[str, Any]:
    """What Lambda returns for an unhandled exception."""
    return {
        "errorMessage": str(exc),
        "errorType": type(exc).__name__,
        "stackTrace": traceback.format_tb(exc.__traceback__),
    }


@contextlib.contextmanager
def _logs_to_stderr() -> Iterator[None]:
    """Like `sam local invoke`: the function's logs go to stderr, so stdout
    carries only the result. Log handlers bound to stdout are pointed at stderr
    for the call (Powertools binds its handler to the stream at import)."""
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


def invoke(spec: FunctionSpec, event: Any) -> InvokeResult:
    """Set the environment, import the handler (its cold start) and call it once;
    its stdout and logs go to stderr."""
    os.environ.update(spec.environment)
    os.environ.update(
        {
            "AWS_LAMBDA_FUNCTION_NAME": spec.logical_id,
            "AWS_LAMBDA_FUNCTION_TIMEOUT": str(int(spec.timeout_seconds)),
            "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(spec.memory_mb),
            "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
        }
    )
    started = time.monotonic()
    context = LambdaContext(spec.logical_id, spec.timeout_seconds, spec.memory_mb)
    outcome = InvokeResult()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # import-time prints, metrics
            handler = load_handler(spec)
            with _logs_to_stderr():
                outcome.result = handler(event, context)
    except InvokeError:
        raise
    except Exception as exc:
        outcome.error = error_document(exc)
        outcome.traceback = traceback.format_exc()
    outcome.duration_seconds = time.monotonic() - started
    outcome.timed_out = outcome.duration_seconds > spec.timeout_seconds
    return outcome
