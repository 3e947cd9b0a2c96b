"""Lemonade's lifecycle routes under `/api/v1` (health, load, unload, stats, pull, delete;
`../shared/spec/lemonade-api.md`); its other routes are the `/v1` ones."""
