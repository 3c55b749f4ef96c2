"""The docs inside the repository say what the code does: the job file reference is the job spec's
own fields, regenerated; the README links the design that lives beside it."""

from pathlib import Path

from tokenmill.spec_docs import job_spec_markdown, spec_sections
from tokenmill.tasks.job import PrefectJob

ROOT = Path(__file__).resolve().parents[1]


def test_the_job_spec_reference_is_the_models_own():
    committed = (ROOT / "docs" / "job-spec.md").read_text()
    assert committed == job_spec_markdown(PrefectJob), (
        "docs/job-spec.md is stale: run `tokenmill spec-docs --out docs/job-spec.md` and commit it")


def test_the_reference_lists_every_field_of_every_section():
    text = job_spec_markdown(PrefectJob)
    for path, section in spec_sections(PrefectJob):
        for name in section.model_fields:
            assert f"| `{name}` |" in text, f"{path or 'job'}.{name} is missing"
    assert "## `gate`: Eval gate" in text and "[Model](#model)" in text  # optional sections, linked types


def test_the_readme_links_the_design_in_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "../shared/" not in readme
    for link in ("docs/design.md", "docs/job-spec.md"):
        assert f"({link})" in readme and (ROOT / link).exists()
