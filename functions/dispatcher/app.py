"""Dispatcher: claims due messages and hands them to the channel functions."""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from outbox.observability import log_metrics, logger
from outbox.runtime import Runtime, cold_start_done

# Settings are checked here, at cold start (and a dispatcher without a
# channel function map refuses to start).
runtime = Runtime.for_dispatcher()
cold_start_done()


@logger.inject_lambda_context(correlation_id_path="execution_id")
@log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return runtime.dispatch(event, context)
