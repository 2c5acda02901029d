# Two commands do all the set-up on a fresh Linux machine with Python 3.11:
#   make run    executes every lesson headless and writes build/summary.csv
#   make test   unit tests + strict nbval over lessons/ and labs/
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
# A pinned torch: a range would pull the newest (multi-GB CUDA) build on a fresh machine.
# On a GPU machine: make TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0
# The supported range: every lesson and lab runs on both ends (make compat-ends; .ci/run runs it).
# pyproject.toml's lower bound is TORCH_OLDEST (tests/test_packaging.py keeps them in step).
TORCH_OLDEST := 2.6.0
TORCH_NEWEST := 2.14.1
# e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu" (CI: CPU wheels, a small download)
TORCH_INDEX ?=
# make compat keeps one environment per TORCH_SPEC here, outside the clone, reused across runs and clones
COMPAT_ROOT ?= /var/tmp/dpfs-compat
COMPAT_ENV = $(COMPAT_ROOT)/$(shell printf '%s' '$(TORCH_SPEC)' | tr -cs 'A-Za-z0-9.' '-' | sed 's/-$$//')
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-portable gpu-check lab book release distribution grade regrade benchmarks compat compat-ends clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[dev,book]"
	touch $(STAMP)

run: install
	$(PY) -m utils.tools.run lessons --out build

# Three workers (pytest-xdist), each taking a whole file at a time (a notebook's cells share one kernel), the longest
# files first (tests/conftest.py): much of the suite waits (on sleeps, time limits, process start-up) rather than
# computes; with one process it kept 2 cores about half busy.
TEST_WORKERS ?= 3
test: install
	$(PY) -m pytest tests lessons labs --nbval --nbval-current-env \
		--nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout=300 -q \
		-n $(TEST_WORKERS) --dist loadfile

# Strict nbval of every notebook again on other CPU code paths: the scalar one and AVX2 (skipped with a line where
# the CPU lacks it). The stored outputs come from one CPU; a compared output that depends on the CPU's instruction
# set fails here. utils/tools/portable.py sets ATen's, MKL's and oneDNN's instruction sets and checks each took.
# ARM's NEON path cannot be chosen on x86 (README, "Outputs on every CPU").
PORTABLE_PATHS ?= scalar avx2
test-portable: install
	$(PY) -m utils.tools.portable $(PORTABLE_PATHS) -- -n $(TEST_WORKERS) --dist loadfile

# On a machine with CUDA: every lesson and lab headless in each configuration a student meets (one GPU as on Colab;
# one rank on NCCL; one GPU per rank where there are enough), as utils/tools/gpu_configs.json lists them; a line per
# notebook and configuration, and the GPU figures they printed, in build/gpu-check/report.txt. Without CUDA: one
# line, exit 1. A CUDA torch: make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126" gpu-check
gpu-check: install
	$(PY) -m utils.tools.gpu_check $(GPU_CHECK_ARGS)

# JupyterLab at lesson 00 with the course's kernel: JUPYTER_PATH puts this environment's kernelspecs
# (python3 = this .venv's Python, the kernel every notebook names) before any the user installed.
# e.g. make lab LAB_ARGS="--no-browser --port 8899"
lab: install
	JUPYTER_PATH=$(abspath $(VENV))/share/jupyter $(PY) -m jupyter lab lessons/00_launching.ipynb $(LAB_ARGS)

# The course as a static website from the stored notebooks (nothing re-executed): build/book/index.html.
# Colab and download links open the student repository: make book STUDENT_REPO=https://github.com/you/course-student
book: install
	$(PY) -m utils.tools.book --out build/book $(if $(STUDENT_REPO),--student-repo $(STUDENT_REPO)) $(if $(BRANCH),--branch $(BRANCH))

# make release STUDENT_REPO=https://github.com/you/course-student   (where students find the copies; INSTRUCTORS.md)
release: install
	$(PY) -m utils.tools.release labs --out release $(if $(STUDENT_REPO),--student-repo $(STUDENT_REPO))

# make distribution DIST=../course-student STUDENT_REPO=https://github.com/you/course-student [BRANCH=main]
# writes the students' repository: lessons, released labs, utils without the grader (INSTRUCTORS.md)
distribution: install
	@test -n "$(DIST)" -a -n "$(STUDENT_REPO)" || { echo "usage: make distribution DIST=<folder> STUDENT_REPO=https://github.com/OWNER/NAME [BRANCH=main]" >&2; exit 2; }
	$(PY) -m utils.tools.distribution $(DIST) --student-repo $(STUDENT_REPO) --branch $(or $(BRANCH),main)

# make grade SUBMISSIONS=submitted [ROSTER=roster.csv]   (layouts, Canvas and Moodle exports: INSTRUCTORS.md)
grade: install
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=<folder of submitted notebooks>" >&2; exit 2; }
	$(PY) -m utils.tools.grade $(SUBMISSIONS) --out build/grades $(if $(ROSTER),--roster $(ROSTER))

# make regrade SUBMISSIONS="submitted/Alan Turing_77_assignsubmission_file_"   (one student's file or folder: their
# rows and feedback in build/grades are replaced, everyone else's kept)
regrade: install
	@test -n "$(SUBMISSIONS)" || { echo "usage: make regrade SUBMISSIONS=<one student's file or folder>" >&2; exit 2; }
	$(PY) -m utils.tools.grade "$(SUBMISSIONS)" --out build/grades --merge $(if $(ROSTER),--roster $(ROSTER))

benchmarks: install
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

# make compat TORCH_SPEC="torch==2.6.0": every lesson and lab headless on that torch (outputs are not compared:
# each notebook must run without an error); executed copies and summary.csv in build/compat-<env name>/
compat:
	mkdir -p $(COMPAT_ROOT)
	test -x $(COMPAT_ENV)/bin/python || $(PYTHON) -m venv $(COMPAT_ENV)
	$(COMPAT_ENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(COMPAT_ENV)/bin/python -m pip install --quiet -e ".[dev]"
	$(COMPAT_ENV)/bin/python -c 'import sys, torch; print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")'
	$(COMPAT_ENV)/bin/python -m utils.tools.run lessons labs --out build/compat-$(notdir $(COMPAT_ENV))

# both ends of the supported range, each as make compat
compat-ends:
	$(MAKE) compat TORCH_SPEC="torch==$(TORCH_OLDEST) $(TORCH_INDEX)"
	$(MAKE) compat TORCH_SPEC="torch==$(TORCH_NEWEST) $(TORCH_INDEX)"

clean:
	rm -rf build release
