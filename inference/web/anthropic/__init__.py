"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`, `../shared/spec/compat.md`)."""
