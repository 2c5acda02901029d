"""The course's command-line tools (not imported by notebooks); each module's docstring says how to run it.

    python -m utils.tools.run lessons --out build     execute notebooks headless, one summary line each

    python -m utils.tools.cluster demo                the README's two-node torchrun command on two namespaces

cluster.py and linkbench.py (measurements on its shaped link) are also imported by a lesson's `%%requires cluster` cell.
kernels.py: the Jupyter kernels these tools start talk over IPC sockets in a private folder.
"""
