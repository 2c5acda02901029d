"""Lab checks: what a lab notebook calls to check a student's implementation, with feedback to act on.

    harness.py   the shared harness: run a function on ranks, turn every failure into one clear message
    lab1.py      lab 1 (collectives from send and recv; the α–β cost model)
    lab2.py      lab 2 (a bucketed, overlapping DDP wrapper)
    lab3.py      lab 3 (a sharded optimizer: ZeRO-1 over whole parameters)

These checks are feedback for the student, run inside the student's notebook. Grades do not come from them:
the instructors' grader computes its verdicts in a process that runs no student code.
"""
