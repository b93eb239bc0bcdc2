"""Migrate: applies the schema (a CloudFormation custom resource, or invoke it)."""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from outbox.migrate import handle
from outbox.observability import logger
from outbox.runtime import Runtime

runtime = Runtime(autocommit=False)  # migrations run in one transaction


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return handle(event, context, lambda: runtime.engine)
