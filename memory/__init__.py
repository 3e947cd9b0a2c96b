"""The tier manager's core: plain Python, no Django, no engine imports."""
