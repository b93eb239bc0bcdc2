"""Push channel function: delivers claimed messages through SNS mobile push endpoints."""

from outbox.runtime import channel_handler

# Settings are checked here, at cold start; the sender runtime does the rest.
handler = channel_handler("push")
