"""Ollama's API (`/api/*`, `../shared/spec/compat.md`): chat, generate, embed, tags, ps, show,
pull, delete, load and unload, answered as Ollama answers."""
