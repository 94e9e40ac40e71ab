"""The course's graders: ``pytest grader/lessonNN`` grades lesson NN (see grader/framework.py)."""
