"""The OpenAI-compatible `/v1` surface (`../shared/spec/hypnos-api.md`), Hypnos's own `/v1`
routes (models, memory, advisor, documents, entities, images) and the realtime WebSocket."""
