"""Reaper: releases expired claims, prunes old rows, publishes backlog metrics."""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from outbox.observability import log_metrics, logger
from outbox.runtime import Runtime

runtime = Runtime()  # settings are checked here, at cold start


@logger.inject_lambda_context(correlation_id_path="execution_id")
@log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return runtime.reap(event, context)
