"""`hypnos`, the operator's command line: it talks to a running Hypnos server over HTTP, as
`ollama` and `lms` talk to theirs, and imports nothing of the server (no Django, no engines), so
it starts in a fraction of a second and works against a server on another machine."""
