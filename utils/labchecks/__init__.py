"""Lab checks: what a lab notebook calls to check a student's implementation, with feedback to act on.

    harness.py   the shared harness: run a function on ranks, turn every failure into one clear message
    lab1.py      lab 1 (collectives from send and recv), with lab1_chunks.py (chunks, positions, inputs),
                 lab1_traffic.py (peers, messages, bytes per algorithm) and lab1_cost.py (the α–β cost model)
    lab2.py      lab 2 (a bucketed, overlapping DDP wrapper), with lab2_cases.py (models, cases, the reference
                 run), lab2_judges.py and handles.py (which handles a rank waits for, and when)
    lab3.py      lab 3 (a sharded optimizer: ZeRO-1 over whole parameters), with lab3_cases.py and lab3_judges.py

These checks are feedback for the student, run inside the student's notebook. Grades do not come from them:
the instructors' grader computes its verdicts in a process that runs no student code.
"""
