"""The job's controller: a pure planner and the elected tick that applies it."""
