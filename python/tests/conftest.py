import os
import sys

# examples/python holds the encoder-parallel step the tests and examples share.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))

import pytest  # noqa: E402

# The tests' mpirun jobs put 3-8 ranks on 2 cores: a rank waiting in MPI must
# yield its core (Open MPI busy-polls otherwise; 16x slower, tests/CMakeLists.txt).
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


def pytest_configure(config):
    # `-m mpi` selects them: scripts/test-python runs the suite against the
    # wheel (built without MPI), then these against the source build.
    config.addinivalue_line("markers", "mpi: needs diffcomm built with MPI (and mpirun)")


@pytest.fixture
def readme_code():
    """readme_code(heading): the first ```python block under README.md's
    `## heading`, as written (tests run the README's examples verbatim)."""
    def code(heading):
        readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
        with open(readme, encoding="utf-8") as f:
            text = f.read()
        section = text[text.index(f"## {heading}"):]
        start = section.index("```python\n") + 10
        return compile(section[start:section.index("\n```", start)], "README.md", "exec")
    return code
