"""The course's command-line tools (not imported by notebooks):

    python -m utils.tools.run lessons --out build     execute every lesson headless   (make run)
    python -m utils.tools.release labs --out release  write students' copies of labs  (make release)
    python -m utils.tools.grade SUBMISSIONS           autograde submitted labs        (make grade)

kernels.py: the Jupyter kernels run and grade start talk over IPC sockets in a private folder.
"""
