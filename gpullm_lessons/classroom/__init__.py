"""Running the course for a class.

    exercises  exercise notebooks generated from the solution notebooks (`python -m gpullm_lessons exercises`)
    grading    `python -m gpullm_lessons grade`: the task list from the course's own exercises, the checkers called
               by the grader, never taken from the notebook it grades
    gradebook  `start` (each learner's own copy of the exercises) and `grade --class` (one gradebook for the class)
    handin     `submit`: a learner's notebooks copied into the lab's drop box, with the time
    leaks      `leaks`: does a lesson show the answer to its exercise?
"""
