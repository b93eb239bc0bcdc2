"""SQS channel function: delivers claimed messages to SQS queues (FIFO-aware)."""

from outbox.runtime import channel_handler

# Settings are checked here, at cold start; the sender runtime does the rest.
handler = channel_handler("sqs")
