package app

import (
	"fmt"
	"os"

	"sigs.k8s.io/yaml"

	"github.com/kvbandit/kvbandit/routing"
)

// FileConfig is the YAML file given with --config. Unknown fields are
// refused so that a typo is an error, not a silently ignored setting.
type FileConfig struct {
	// Endpoints is a static endpoint list with metadata (models, block
	// size, ...). It is an alternative to --endpoints.
	Endpoints []routing.Endpoint `json:"endpoints,omitempty"`
	// PassThroughUnknownModels routes requests for a model that no endpoint
	// declares to any endpoint, instead of answering 404 model_not_found.
	PassThroughUnknownModels bool `json:"pass_through_unknown_models,omitempty"`
}

// LoadConfig reads, strictly decodes and validates a config file.
func LoadConfig(path string) (*FileConfig, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return ParseConfig(raw)
}

// ParseConfig strictly decodes and validates config YAML.
func ParseConfig(raw []byte) (*FileConfig, error) {
	var c FileConfig
	if err := yaml.UnmarshalStrict(raw, &c); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if len(c.Endpoints) > 0 {
		set := routing.EndpointSet{Source: "config", Endpoints: c.Endpoints}
		if err := set.Validate(); err != nil {
			return nil, fmt.Errorf("config: endpoints: %w", err)
		}
	}
	return &c, nil
}
