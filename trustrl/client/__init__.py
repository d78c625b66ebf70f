"""The agent client: ``Agent`` acts on a policy snapshot with the acting side and ships
chunks to a learner. ``Agent.local`` is the one exception to the layers: it runs a learner
in the application's process by design, and imports the run layer lazily."""
