"""What the tests run or import that is not a test: fake and faulty servers, worker processes, plug-in tasks,
reference implementations and fixture writers."""
