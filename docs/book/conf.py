"""Sphinx configuration of the course website (built by `make book`: utils/tools/book.py writes the sources).

Why Sphinx with MyST-NB and the Sphinx Book Theme: all three install from PyPI with the course's own pip (no
Node toolchain for the build itself), MyST-NB renders stored outputs without executing anything, and the theme
brings what a reader expects of a course site — a table of contents, previous/next links, Colab launch and
download buttons, and Sphinx's own search index, which works offline. Jupyter Book 2 (MyST) would need Node
and fetches its theme at build time.
"""
import os

project = "Data Parallelism from Scratch"
author = "the course's authors"
copyright = "the course's authors, MIT licence"

extensions = ["myst_nb"]
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "utils/**", "benchmarks/**", "lessons/scripts/**",
                    "_static/**"]
suppress_warnings = ["myst.header"]   # a notebook's first heading may be h2 after the badge line

# Pages are the stored, executed notebooks: nothing runs at build time.
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# Offline: MathJax from the site itself (utils/tools/book.py copies npm's build into _static/mathjax), and no
# widget JavaScript (it would come from a CDN). A widget's output falls back to its stored text form.
mathjax_path = "mathjax/tex-chtml.js"
nb_ipywidgets_js = {}
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]

repo = os.environ.get("BOOK_STUDENT_REPO", "https://github.com/dp-from-scratch/dp-from-scratch-student")
branch = os.environ.get("BOOK_BRANCH", "main")

html_theme = "sphinx_book_theme"
html_title = project
html_favicon = "favicon.svg"   # without one, every page logs a 404 for /favicon.ico
html_static_path = [os.environ.get("BOOK_STATIC", "_static")]   # MathJax: the source folder's _static
html_theme_options = {
    "repository_url": repo,
    "repository_branch": branch,
    "path_to_docs": "",
    "use_repository_button": True,
    "use_download_button": True,
    "launch_buttons": {"colab_url": "https://colab.research.google.com"},
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_last_updated_fmt = None
smartquotes = False         # headings and prose read exactly as in the notebooks
html_context = {"default_mode": "light"}   # the theme logs a console error when no mode is set
html_copy_source = True      # the "download .ipynb" button serves the student copy from _sources/


def add_student_download(app, pagename, templatename, context, doctree):
    """Beside the theme's download of the page's notebook, a link to the same file in the student repository."""
    if context.get("page_source_suffix") != ".ipynb":
        return
    source = f"{pagename}.ipynb"
    for button in context.get("header_buttons", []):
        if button.get("label") == "download-buttons":
            button["buttons"].insert(1, {
                "type": "link", "url": f"{repo.replace('github.com', 'raw.githubusercontent.com')}/{branch}/{source}",
                "text": ".ipynb (student repository)", "icon": "fab fa-github",
                "tooltip": "Download this notebook from the student repository",
                "label": "download-student-notebook-button"})


def setup(app):
    app.connect("html-page-context", add_student_download, priority=600)
