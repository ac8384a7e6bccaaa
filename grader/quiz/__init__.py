"""Multiple-choice quizzes on DDP, asked in the terminal."""
