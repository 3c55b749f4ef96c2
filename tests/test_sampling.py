"""A corpus's deterministic samples (tokenmill.sampling): one read per process for the same files read the
same way (a gated run's gate, prediction and flow all take its gate's sample), a new read once a file changed."""

import os

from conftest import TEST_EMBED_MODEL, write_parquet
from tokenmill import sampling
from tokenmill.spec import JobSpec


def spec_for(tmp_path, corpus, **overrides) -> JobSpec:
    fields = dict(input=str(corpus), output=str(tmp_path / "out"), mode="embed", model=TEST_EMBED_MODEL)
    return JobSpec.model_validate({**fields, **overrides})


def test_a_sample_is_read_once_per_process_until_its_file_changes(tmp_path, monkeypatch):
    reads = []
    real = sampling.read_job_rows
    monkeypatch.setattr(sampling, "read_job_rows", lambda shard, job: reads.append(shard.uri) or real(shard, job))
    monkeypatch.setattr(sampling, "_POOLS", {})
    corpus = write_parquet(tmp_path / "docs.parquet", [f"d{i}" for i in range(40)], [f"text {i}" for i in range(40)],
                           title=[f"title {i}" for i in range(40)])
    spec = spec_for(tmp_path, corpus)

    first, source = sampling.corpus_sample(spec, 8)
    again, _ = sampling.corpus_sample(spec.model_copy(update={"output": str(tmp_path / "elsewhere")}), 8)
    assert (again, len(reads)) == (first, 1)  # another output, the same rows: not read again
    assert source == "8 corpus rows by id hash"

    titles, _ = sampling.corpus_sample(spec_for(tmp_path, corpus, text_column="title"), 8)
    assert len(reads) == 2 and all(text.startswith("title ") for text in titles)  # read another way: read

    write_parquet(corpus, [f"d{i}" for i in range(40)], [f"new {i}" for i in range(40)],
                  title=[f"title {i}" for i in range(40)])
    stat = corpus.stat()
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a rewrite, whatever the clock
    rewritten, _ = sampling.corpus_sample(spec, 8)
    assert len(reads) == 3 and all(text.startswith("new ") for text in rewritten)
    assert len(sampling._POOLS) == sampling.POOLS_KEPT  # the oldest let go
