"""The course's command-line tools (not imported by notebooks); each module's docstring says how to run it.

    python -m utils.tools.run lessons --out build     execute notebooks headless, one summary line each

kernels.py: the Jupyter kernels these tools start talk over IPC sockets in a private folder.
"""
