// The worker's unit tests (doctest): each TEST_CASE is a ctest case (doctest_discover_tests).
// Tests that need a model read its path from DGR_TEST_MODEL (nox -s test-native sets it to the
// default model, SmolLM2); without it they fail, naming the variable.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
