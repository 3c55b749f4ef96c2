"""tokenmill: offline batch embeddings and generation, as Prefect flows running vLLM.

The job is one declarative object, `tokenmill.spec.JobSpec`. The core modules here are plain
Python with no Prefect import; the Prefect layer is `tokenmill.tasks` (tasks to compose into
your own flows) and `tokenmill.flows` (the flows). `import tokenmill` stays light: it imports
neither Prefect nor vLLM.
"""

__version__ = "0.1.0"
