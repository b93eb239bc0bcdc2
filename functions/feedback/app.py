"""Feedback: records SES bounce, complaint and delivery events (via SNS or EventBridge)."""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from outbox.observability import logger, metrics
from outbox.runtime import Runtime

runtime = Runtime()  # settings are checked here, at cold start


@logger.inject_lambda_context
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return runtime.feedback(event)
